"""A worker killed mid-generation (SIGKILL: no drain, no goodbye) loses nothing that can be recovered.

Real Redis, real uvicorn, real worker processes with the default model on the CPU. Worker A takes three
requests and is killed once two of them are streaming; worker B starts afterwards and must pick the jobs up
within the lease: the greedy stream goes on exactly where it stopped, the unseeded non-streaming request is
simply run again, and the sampled stream the client sent without a seed goes on where it stopped too: the API
gave it a seed at admission, so the rerun samples the same tokens (a rerun that came out different would end
with a clear ``worker_lost`` error, never a stream spliced from two generations).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ServerThread, start_api

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 3.0
MAX_TOKENS = 48


def start_worker(redis_url: str, worker_id: str, *extra: str) -> subprocess.Popen[bytes]:
    """``pagedserve worker`` on the CPU with the default model (``extra`` flags win), short job lease."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "deploy.cli", "worker", "--redis-url", redis_url, "--device", "cpu"]
    argv += ["--max-num-seqs", "8", "--worker-id", worker_id, "--job-lease-s", str(LEASE_S)]
    return subprocess.Popen([*argv, "--log-level", "warning", *extra], env=env, cwd=ROOT)


def wait_ready(api: ServerThread, workers: int, proc: subprocess.Popen[bytes]) -> None:
    """Until /ready counts ``workers`` live workers (``proc`` must stay up meanwhile)."""
    deadline = time.monotonic() + 180
    while httpx.get(api.url + "/ready").json().get("workers") != workers:
        assert proc.poll() is None, "the worker died at start"
        assert time.monotonic() < deadline, "the worker did not become ready"
        time.sleep(0.2)


@pytest.fixture
def api(redis_server: RedisServer, redis_url: str) -> Iterator[ServerThread]:
    server = start_api(redis_server, response_cache=False)
    yield server
    server.stop()


class PostThread(threading.Thread):
    """One non-streamed completion in the background: an undisturbed reference that runs beside the streams a
    test is waiting for, instead of after them."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.url + "/v1/completions", json=self.body, timeout=150)

    def result(self) -> dict[str, Any]:
        self.join(150)
        assert self.response is not None, "the reference request did not finish"
        assert self.response.status_code == 200, self.response.text
        return dict(self.response.json())


def post_in_thread(url: str, body: dict[str, Any]) -> PostThread:
    thread = PostThread(url, body)
    thread.start()
    return thread


class StreamReader(threading.Thread):
    """Reads one SSE completion stream to its end; ``started`` is set after ``warmup`` chunks with text."""

    def __init__(self, url: str, body: dict[str, Any], warmup: int = 3) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.warmup = url, body, warmup
        self.started = threading.Event()
        self.accepted = threading.Event()  # the response's status line arrived (``status``): admitted or refused
        self.status = 0
        self.chunks: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.done = False

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as resp:
            self.status = resp.status_code
            self.accepted.set()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    self.done = self.done or line == "data: [DONE]"
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    self.errors.append(data["error"])
                    continue
                self.chunks.append(data)
                if sum(1 for c in self.chunks if c["choices"] and c["choices"][0]["text"]) >= self.warmup:
                    self.started.set()
        self.started.set()
        self.accepted.set()

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.chunks if c["choices"])


def test_killed_worker_jobs_are_continued_rerun_or_failed_clearly(api: ServerThread, redis_url: str) -> None:
    base = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    greedy = {**base, "prompt": "Tell me a story about a dragon.", "temperature": 0.0}
    sampled = {**base, "prompt": "Write a poem about the sea.", "temperature": 1.0}
    worker_a = start_worker(redis_url, "failover-a")
    worker_b: subprocess.Popen[bytes] | None = None
    try:
        wait_ready(api, 1, worker_a)
        greedy_stream = StreamReader(api.url, {**greedy, "stream": True, "stream_options": {"include_usage": True}})
        sampled_stream = StreamReader(api.url, {**sampled, "stream": True})
        non_stream: dict[str, Any] = {}

        def post_non_stream() -> None:
            resp = httpx.post(api.url + "/v1/completions", json={**sampled, "seed": None}, timeout=120)
            non_stream.update(status=resp.status_code, body=resp.json())

        poster = threading.Thread(target=post_non_stream, daemon=True)
        for t in (greedy_stream, sampled_stream, poster):
            t.start()
        assert greedy_stream.started.wait(120) and sampled_stream.started.wait(120)
        assert not greedy_stream.done and not sampled_stream.done and not non_stream, "finished before the kill"
        worker_a.kill()
        worker_a.wait()
        killed_at = time.monotonic()
        worker_b = start_worker(redis_url, "failover-b")
        reference = post_in_thread(api.url, greedy)  # run by worker B beside the jobs it takes over
        for name, t in (("greedy stream", greedy_stream), ("sampled stream", sampled_stream), ("post", poster)):
            t.join(150)
            assert not t.is_alive(), f"the {name} hangs after its worker died"
        recovered_in = time.monotonic() - killed_at

        # the greedy stream went on where it stopped: complete, nothing twice, same as an undisturbed run
        assert greedy_stream.errors == [] and greedy_stream.done
        usage = greedy_stream.chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert greedy_stream.chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert greedy_stream.text == reference.result()["choices"][0]["text"]

        # the stream sent without a seed was seeded at admission: it is continued, not failed
        assert sampled_stream.errors == [] and sampled_stream.done, sampled_stream.errors
        assert sampled_stream.chunks[-1]["choices"][0]["finish_reason"] == "length"

        # the non-streaming request was run again from the start and answered in full
        assert non_stream["status"] == 200, non_stream
        assert non_stream["body"]["usage"]["completion_tokens"] == MAX_TOKENS
        assert recovered_in < 120
    finally:
        for w in (worker_a, worker_b):
            if w is not None and w.poll() is None:
                w.kill()
                w.wait()
