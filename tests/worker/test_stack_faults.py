"""The whole stack on the CPU: real Redis, real uvicorn, real worker processes (front + engine core each).

- The engine core of a worker is SIGKILLed mid-stream: its front notices at once and exits non-zero, and
  the streams it was serving continue on another worker exactly where they stopped.
- 256 concurrent seeded streams on a tiny model, through a worker with two fronts: each stream's text equals
  the non-streamed answer for the same seed, with every token once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ServerThread, start_api
from tests.api.test_failover import StreamReader, post_in_thread, start_worker, wait_ready
from tests.helpers import build_tiny_model
from worker.front import EXIT_CORE_DIED

pytestmark = pytest.mark.slow


@pytest.fixture
def api(redis_server: RedisServer, redis_url: str) -> Iterator[ServerThread]:
    server = start_api(redis_server, response_cache=False)
    yield server
    server.stop()


def test_killed_engine_core_takes_its_worker_down_and_streams_continue_elsewhere(
    api: ServerThread, redis_url: str
) -> None:
    prompts = ["Tell me a story about a dragon.", "Describe a city at night.", "Explain how rain forms."]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 48, "ignore_eos": True, "temperature": 0.0} for p in prompts]
    worker_a = start_worker(redis_url, "core-dies-a")
    worker_b: subprocess.Popen[bytes] | None = None
    try:
        wait_ready(api, 1, worker_a)
        readers = [StreamReader(api.url, {**b, "stream": True}) for b in bodies]
        for r in readers:
            r.start()
        assert all(r.started.wait(120) for r in readers) and not any(r.done for r in readers)
        children = psutil.Process(worker_a.pid).children()
        (core,) = [c for c in children if "spawn_main" in " ".join(c.cmdline())]  # not the resource tracker
        core.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert worker_a.wait(10) == EXIT_CORE_DIED
        assert time.monotonic() - killed_at < 2.0, "the front took too long to notice its engine core died"
        worker_b = start_worker(redis_url, "core-dies-b")
        references = [post_in_thread(api.url, b) for b in bodies]  # run by worker B beside the streams it continues
        for r in readers:
            r.join(150)
            assert not r.is_alive(), "a stream hangs after its engine core died"
        for reference, r in zip(references, readers, strict=True):
            assert r.errors == [] and r.done
            assert r.text == reference.result()["choices"][0]["text"]
    finally:
        for w in (worker_a, worker_b):
            if w is not None and w.poll() is None:
                w.kill()
                w.wait()


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[str], list[str], int | None, bool]:
    pieces: list[str] = []
    tokens: list[str] = []
    usage: int | None = None
    done = False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True, **_USAGE}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    pieces.append(chunk["choices"][0]["text"])
                    tokens += (chunk["choices"][0].get("logprobs") or {}).get("tokens") or []
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
    return pieces, tokens, usage, done


_USAGE = {"stream_options": {"include_usage": True}}


def test_256_concurrent_seeded_streams_equal_their_non_streamed_answers(
    redis_server: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    folder = build_tiny_model(tmp_path / "tiny", "llama", seed=11)
    api = start_api(redis_server, model=str(folder), response_cache=False, max_queue_depth=4096)
    # two fronts on the one core (as a GPU node runs them): each stream is served by one of them
    worker = start_worker(
        redis_url, "many-streams", "--model", str(folder), "--max-num-seqs", "256", "--worker-fronts", "2"
    )
    try:
        wait_ready(api, 2, worker)
        max_tokens = 24
        bodies = [
            {"model": folder.name, "prompt": f"stream {i}:", "max_tokens": max_tokens, "temperature": 1.0,
             "seed": 1000 + i, "ignore_eos": True, "logprobs": 0}
            for i in range(256)
        ]  # fmt: skip

        async def run() -> tuple[list[Any], list[Any]]:
            # idle connections expire before uvicorn's 5 s keep-alive closes them (reusing one it is closing fails)
            limits = httpx.Limits(max_connections=300, max_keepalive_connections=300, keepalive_expiry=1.0)
            async with httpx.AsyncClient(base_url=api.url, limits=limits, timeout=300) as client:
                streamed = await asyncio.gather(*(_stream(client, b) for b in bodies))
                whole = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            return list(streamed), [r.json() for r in whole]

        streamed, whole = asyncio.run(run())
        for (pieces, tokens, usage, done), answer in zip(streamed, whole, strict=True):
            assert done and usage == max_tokens
            assert answer["usage"]["completion_tokens"] == max_tokens
            assert tokens == answer["choices"][0]["logprobs"]["tokens"] and len(tokens) == max_tokens  # each once
            assert "".join(pieces) == answer["choices"][0]["text"]
    finally:
        api.stop()
        worker.kill()
        worker.wait()
