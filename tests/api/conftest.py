"""API test helpers: the real app under real uvicorn (in a thread) on a free port, and a scripted worker
that answers jobs from the real Redis queue (for API tests that do not need the engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
import uvicorn

from api.app import create_app
from api.settings import ApiSettings
from deploy.redis_server import RedisServer, free_port
from wire import keys
from wire.messages import ChoiceDelta, ChoiceResult, JobPayload, JobResult, loads
from wire.publisher import JobEventWriter


class ServerThread:
    """uvicorn serving ``create_app(settings)`` in a daemon thread."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self.port = free_port()
        config = uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("API server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_api(redis_server: RedisServer, **overrides: object) -> ServerThread:
    """The scripted worker sends no heartbeats, so these APIs queue without a live worker unless a test sets
    ``queue_without_workers_s`` (the default of ApiSettings answers 503 at once)."""
    values: dict[str, object] = {"queue_without_workers_s": math.inf, **overrides}
    settings = ApiSettings(redis_url=redis_server.url, **values)  # type: ignore[arg-type]
    return ServerThread(settings).start()


@pytest.fixture(scope="module")
def api(redis_server: RedisServer) -> Iterator[ServerThread]:
    """An API with default settings, shared by a module."""
    server = start_api(redis_server)
    yield server
    server.stop()


MODEL = "SmolLM2-135M-Instruct"


@dataclass
class ScriptedWorker:
    """Takes jobs off the real arq queue and answers each with ``pieces`` as deltas, then the final result.
    Stands in for the engine so API behaviour (relay, SSE, cache, framing) is testable on its own."""

    redis_url: str
    pieces: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    unpublished: set[int] = field(default_factory=set)  # seqs written to the list but not published (lost)
    duplicated: set[int] = field(default_factory=set)  # seqs published twice
    payloads: list[JobPayload] = field(default_factory=list)
    step_s: float = 0.0  # pause after each delta, as an engine's steps are apart (0: back to back, merged if late)
    # a streamed job's final, as the worker front writes it: only what the deltas did not carry (the last piece
    # if ``rest_in_final``, else nothing); ``whole_finals``: the whole answer (the encoding of stored answers)
    whole_finals: bool = False
    rest_in_final: bool = False

    async def take(self, timeout_s: float = 10.0) -> JobPayload:
        client = aioredis.Redis.from_url(self.redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                for job_id in await client.zrange(keys.QUEUE, 0, -1):
                    if await client.zrem(keys.QUEUE, job_id):
                        job = loads(await client.get(keys.ARQ_JOB_PREFIX + job_id.decode()))
                        payload = JobPayload.from_dict(job["a"][0])
                        self.payloads.append(payload)
                        return payload
                await asyncio.sleep(0.01)
            raise TimeoutError("no job queued")
        finally:
            await client.aclose()

    async def answer(self, payload: JobPayload, finish_reason: str = "stop") -> JobResult:
        client = aioredis.Redis.from_url(self.redis_url)
        writer = JobEventWriter(
            client, payload.request_id, 60, publish_deltas=payload.stream, channel=payload.reply_channel
        )
        try:
            n = payload.params.n
            streamed = payload.stream and not self.whole_finals
            as_deltas = self.pieces[:-1] if streamed and self.rest_in_final else self.pieces
            for i, piece in enumerate(as_deltas):
                seq = writer.next_seq
                choices = [ChoiceDelta(k, piece, [100 + i]) for k in range(n)]
                await writer.delta(choices, publish=seq not in self.unpublished)
                if self.step_s:
                    await asyncio.sleep(self.step_s)
                if seq in self.duplicated:
                    raw = await client.lindex(keys.events_key(payload.request_id), seq)
                    batch = json.dumps([[payload.request_id, json.loads(raw or b"{}")]])
                    await client.publish(writer.channel, batch)
            text = "".join(self.pieces)
            ids = [100 + i for i in range(len(self.pieces))]
            result = JobResult(
                payload.request_id,
                payload.model,
                [ChoiceResult(k, text, ids, finish_reason) for k in range(n)],
                len(payload.prompt_token_ids),
                n * len(ids),
            )
            if not streamed:
                await writer.final(result)
                return result
            rest, rest_ids = ("".join(self.pieces[len(as_deltas) :]), ids[len(as_deltas) :])
            slim = [ChoiceResult(k, rest, rest_ids, finish_reason) for k in range(n)]
            await writer.final(dataclasses.replace(result, choices=slim), streamed=True)
            return result
        finally:
            await client.aclose()

    async def serve(self, count: int = 1) -> None:
        for _ in range(count):
            await self.answer(await self.take())
