"""Redis going away under the API, with real processes and no engine: a private redis-server of the test's
own is SIGKILLed (as ``kill -9``) while a real uvicorn API streams a job that a scripted worker answers.

- Redis back within the outage limit (with its append-only file): the stream goes on and completes.
- Redis away for longer: the stream ends with a ``redis_unavailable`` error chunk and ``[DONE]``; /ready is 503
  meanwhile, and once Redis is back the API serves again without a restart.
- Redis back without its data: the stream ends with ``job_lost`` instead of waiting for events that will
  never come.

Plus the pieces under them: the restart policy of ``pagedserve serve`` (real child processes), the private
Redis keeping its data across a kill, and an event batch written again after a failed write.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from fastapi import FastAPI

from api.relay import EventRelay
from deploy.redis_server import RedisServer
from deploy.supervisor import GaveUpError, RestartPolicy, Supervisor, popen_in_own_group
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire import keys
from wire.messages import ChoiceDelta, ChoiceResult, DeltaEvent, JobPayload, JobResult
from wire.publisher import EventBatch, JobEventWriter

BODY = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis this test may kill (the session's is shared); append-only, as ``pagedserve serve`` runs it."""
    with RedisServer(appendonly=True) as server:
        yield server


def _kill(server: RedisServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()


@pytest.fixture
def api(own_redis: RedisServer) -> Iterator[ServerThread]:
    server = start_api(own_redis, response_cache=False)
    yield server
    server.stop()


def _relay(api: ServerThread) -> EventRelay:
    app: FastAPI = api.server.config.app  # type: ignore[assignment]
    relay: EventRelay = app.state.svc.relay
    return relay


async def _read(client: httpx.AsyncClient) -> dict[str, Any]:
    """One OpenAI stream to its end: its text, error objects and whether ``[DONE]`` came."""
    out: dict[str, Any] = {"text": "", "errors": [], "done": False}
    async with client.stream("POST", "/v1/completions", json=BODY) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["errors"].append(chunk["error"])
                elif chunk["choices"]:
                    out["text"] += chunk["choices"][0]["text"]
    return out


async def _write(url: str, payload: JobPayload, seq: int, *pieces: str, final: bool = False) -> None:
    client = aioredis.Redis.from_url(url)
    writer = JobEventWriter(client, payload.request_id, 60, next_seq=seq, channel=payload.reply_channel)
    try:
        for i, piece in enumerate(pieces):
            await writer.delta([ChoiceDelta(0, piece, [100 + seq + i])])
        if final:
            ids = list(range(100, 100 + writer.next_seq))
            result = JobResult(payload.request_id, payload.model, [ChoiceResult(0, "", ids, "length")], 1, len(ids))
            await writer.final(result)
    finally:
        await client.aclose()


async def _started(client: httpx.AsyncClient, worker: ScriptedWorker) -> tuple[Any, JobPayload]:
    """A stream reading in the background, and its job as the (scripted) worker took it."""
    reading = asyncio.create_task(_read(client))
    payload = await worker.take()
    return reading, payload


async def test_a_stream_goes_on_after_redis_is_killed_and_restarted(api: ServerThread, own_redis: RedisServer) -> None:
    worker = ScriptedWorker(own_redis.url)
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as client:
        reading, payload = await _started(client, worker)
        await _write(own_redis.url, payload, 0, "Hel")
        await asyncio.sleep(0.3)
        _kill(own_redis)
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "redis unavailable"
        await asyncio.sleep(1.0)  # the reader polls the (unreachable) events list meanwhile
        own_redis.start()  # same port, same append-only file: the job's first event is still there
        await _write(own_redis.url, payload, 1, "lo", "!", final=True)
        out = await asyncio.wait_for(reading, 20)
    assert out == {"text": "Hello!", "errors": [], "done": True}


async def test_a_long_outage_ends_the_stream_with_an_error_and_the_api_recovers(
    api: ServerThread, own_redis: RedisServer
) -> None:
    _relay(api).outage_s = 1.0
    worker = ScriptedWorker(own_redis.url)
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as client:
        reading, payload = await _started(client, worker)
        await _write(own_redis.url, payload, 0, "Hel")
        await asyncio.sleep(0.3)
        _kill(own_redis)
        killed_at = time.monotonic()
        out = await asyncio.wait_for(reading, 20)
        assert time.monotonic() - killed_at < 10
        assert out["text"] == "Hel" and out["done"]
        assert [e["code"] for e in out["errors"]] == ["redis_unavailable"], out
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "redis unavailable"
        new = await client.post("/v1/completions", json={**BODY, "stream": False})
        assert new.status_code == 503 and new.json()["error"]["type"] == "service_unavailable"

        own_redis.start()
        ready = await client.get("/ready")
        assert ready.json()["status"] != "redis unavailable"  # (no worker sends heartbeats here)
        again, _ = await asyncio.gather(_read(client), worker.serve())
    assert again == {"text": "Hello, world!", "errors": [], "done": True}


async def test_redis_back_without_the_job_ends_its_stream_with_job_lost() -> None:
    with RedisServer() as volatile:  # no append-only file: a restart comes back empty
        api = start_api(volatile, response_cache=False)
        try:
            worker = ScriptedWorker(volatile.url)
            async with httpx.AsyncClient(base_url=api.url, timeout=30) as client:
                reading, payload = await _started(client, worker)
                await _write(volatile.url, payload, 0, "Hel")
                await asyncio.sleep(0.3)
                _kill(volatile)
                volatile.start()
                out = await asyncio.wait_for(reading, 20)
        finally:
            api.stop()
    assert out["text"] == "Hel" and out["done"]
    assert [e["code"] for e in out["errors"]] == ["job_lost"], out


def test_private_redis_keeps_its_data_across_a_kill(own_redis: RedisServer) -> None:
    client = redis.Redis.from_url(own_redis.url)
    client.rpush("queue", "job-1", "job-2")
    _kill(own_redis)
    own_redis.start()
    client = redis.Redis.from_url(own_redis.url)
    assert client.lrange("queue", 0, -1) == [b"job-1", b"job-2"]
    client.close()


async def test_a_failed_event_batch_is_written_whole_when_retried(own_redis: RedisServer) -> None:
    batch = EventBatch()
    for seq in range(3):
        batch.add("job", DeltaEvent(seq, [ChoiceDelta(0, str(seq), [seq])]), 60, "chan")
    _kill(own_redis)
    client = aioredis.Redis.from_url(own_redis.url)
    with pytest.raises(redis.ConnectionError):
        await batch.execute(client)
    own_redis.start()
    await batch.execute(client)
    assert len(await client.lrange(keys.events_key("job"), 0, -1)) == 3  # type: ignore[misc]
    await client.aclose()


def _supervise_until_gave_up(sup: Supervisor, timeout_s: float) -> GaveUpError:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            sup.check()
        except GaveUpError as exc:
            return exc
        time.sleep(0.02)
    raise AssertionError("the supervisor did not give up")


def test_supervisor_restarts_a_killed_child_and_gives_up_on_one_that_keeps_crashing() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.1, max_backoff_s=0.2))
    sleeper = sup.add(
        "sleeper", functools.partial(popen_in_own_group, [sys.executable, "-c", "import time; time.sleep(60)"])
    )
    try:
        first = sleeper.pid
        assert sleeper.proc is not None
        sleeper.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sleeper.pid == first or sleeper.restart_at is not None:
            assert time.monotonic() < deadline, "the killed child was not restarted"
            sup.check()
            time.sleep(0.02)
        assert sleeper.num_restarts == 1 and sleeper.proc is not None and sleeper.proc.poll() is None

        crasher = sup.add(
            "crasher", functools.partial(popen_in_own_group, [sys.executable, "-c", "raise SystemExit(3)"])
        )
        exc = _supervise_until_gave_up(sup, 20)
        assert "crasher exited with status 3" in str(exc) and "3 times" in str(exc)
        assert crasher.num_restarts == 2  # backoff 0.1 s, then 0.2 s
    finally:
        sup.stop(timeout_s=5)
    assert sleeper.proc.poll() is not None
