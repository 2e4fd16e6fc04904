"""Schemathesis against the API's own OpenAPI schema (real uvicorn, real Redis): bodies, paths and queries
generated from the schema (valid ones, then invalid ones) never get a status >= 500. Requests that pass
validation are queued and answered by a scripted worker that also sends heartbeats (so /ready is 200)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from api.protocol import NOT_IMPLEMENTED
from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire import keys
from wire.messages import WorkerHeartbeat

pytestmark = pytest.mark.slow
EXAMPLES = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 10}  # per operation: ~30 s on 2 cores
WORKER_ID = "fuzz-worker"


class BeatingWorker:
    """``ScriptedWorker`` on a thread of its own, answering every job it finds and beating every second."""

    def __init__(self, redis_url: str) -> None:
        self.worker = ScriptedWorker(redis_url, pieces=["fuzz", "ed"])
        self.redis_url = redis_url
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _beat(self, client: aioredis.Redis) -> None:
        beat = WorkerHeartbeat(WORKER_ID, MODEL, capacity=64, max_model_len=8192, time=time.time())
        await client.set(keys.worker_key(WORKER_ID), beat.to_json(), ex=10)
        await client.zadd(keys.WORKERS, {WORKER_ID: beat.time})

    async def _run(self) -> None:
        client = aioredis.Redis.from_url(self.redis_url)
        try:
            beat_at = 0.0
            while not self.stopping.is_set():
                if time.monotonic() - beat_at > 1.0:
                    await self._beat(client)
                    beat_at = time.monotonic()
                with contextlib.suppress(TimeoutError):  # no job within 0.5 s: beat, look again
                    await self.worker.answer(await self.worker.take(timeout_s=0.5))
        finally:
            await client.aclose()

    def __enter__(self) -> BeatingWorker:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def fuzzed_api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(redis_server, request_timeout_s=20.0)
    with BeatingWorker(redis_server.url):
        yield server
    server.stop()


def _steer(body: Any) -> None:
    """Make a valid body one this server serves: generated ones mostly name another model or ask for a
    feature it refuses (both 4xx at once), and the queue, the worker and the formatting would go untested."""
    if not isinstance(body, dict):
        return
    if "model" in body or "messages" in body or "prompt" in body:
        body["model"] = MODEL
    for name in NOT_IMPLEMENTED:
        body.pop(name, None)
    for message in body.get("messages") or ():
        for name in ("tool_calls", "function_call", "audio"):
            message.pop(name, None)
        if isinstance(message.get("content"), list):
            message["content"] = [p for p in message["content"] if p.get("type") == "text"]


def _fuzz(operation: Any, mode: GenerationMode, url: str, session: requests.Session) -> list[str]:
    """The operation's cases that got a 5xx (or no answer), as ``METHOD path -> status: body`` lines."""
    failures: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure reproduces
        phases=[Phase.explicit, Phase.generate],  # no shrinking: failures are collected, not raised
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        if mode is GenerationMode.POSITIVE:
            _steer(case.body)
        try:
            resp = case.call(base_url=url, session=session, timeout=30)
        except requests.RequestException as exc:
            failures.append(f"{case.method} {case.formatted_path} -> {type(exc).__name__}: {exc}")
            return
        if resp.status_code >= 500:
            failures.append(f"{case.method} {case.formatted_path} -> {resp.status_code}: {resp.text[:300]}")

    try:
        run()
    except Unsatisfiable:
        # negative mode on an operation whose inputs have no invalid value (none, or a string path parameter)
        if mode is GenerationMode.POSITIVE:
            raise
    return failures


def test_no_server_errors(fuzzed_api: ServerThread, redis_url: str) -> None:
    schema = schemathesis.openapi.from_url(fuzzed_api.url + "/openapi.json")
    failures: list[str] = []
    num_operations = 0
    with requests.Session() as session:  # one keep-alive connection: a 4xx must not break it either
        for result in schema.get_all_operations():
            operation = result.ok()
            num_operations += 1
            for mode in EXAMPLES:
                failures += _fuzz(operation, mode, fuzzed_api.url, session)
    assert num_operations >= 12  # the schema declares every endpoint
    assert not failures, "\n".join(failures[:20])
