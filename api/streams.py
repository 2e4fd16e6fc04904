"""HTTP framing of a job's events: the non-streaming body, OpenAI SSE (``data: {chunk}`` … ``data: [DONE]``),
and the EventSource stream of /v1/jobs/{id}/events (``id:`` on every event, resume from Last-Event-ID)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError
from sse_starlette import ServerSentEvent
from starlette.requests import Request

from api.errors import ApiError, error_body
from api.formatting import ResponseFormatter, replay_deltas
from api.relay import Subscription
from api.service import CompletionService, PreparedRequest
from wire.messages import ErrorEvent, Event, FinalEvent, JobMeta, JobResult

DONE = "[DONE]"
REDIS_DOWN_MESSAGE = "the job queue (Redis) failed under this request; its outcome is unknown: retry it"
logger = logging.getLogger(__name__)


def _dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _error_from_event(ev: ErrorEvent) -> ApiError:
    return ApiError(ev.status, ev.message, ev.type, code=ev.code)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def formatter_for(svc: CompletionService, prep: PreparedRequest) -> ResponseFormatter:
    return ResponseFormatter(prep.kind, prep.request_id, prep.model, prep.created, svc.tokenizer, prep.echo)


def _observe_final(svc: CompletionService, prep: PreparedRequest, result: JobResult) -> None:
    svc.metrics.observe_final(result, time.monotonic() - prep.arrival, prep.stream)


async def collect(svc: CompletionService, prep: PreparedRequest, sub: Subscription, request: Request) -> JobResult:
    """Wait for the job's final event (deltas are not sent for non-streaming jobs); a client that hangs up
    meanwhile gets its job aborted."""

    async def final() -> Event:
        async for ev in svc.relay.events(sub, timeout_s=svc.settings.request_timeout_s):
            if ev.kind != "delta":
                return ev
        raise RuntimeError("event stream ended without a final event")

    waiter = asyncio.ensure_future(final())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    finished = False
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            raise ApiError(499, "client closed the request", code="client_closed")
        ev = waiter.result()
        finished = True
    finally:
        for task in (waiter, watcher):
            task.cancel()
        svc.spawn(_release(svc, sub, abort=not finished))
    if isinstance(ev, ErrorEvent):
        svc.metrics.errors.labels(str(ev.status)).inc()
        raise _error_from_event(ev)
    assert isinstance(ev, FinalEvent)
    _observe_final(svc, prep, ev.result)
    await _remember(svc, prep, ev.result)
    return ev.result


@dataclass
class _Progress:
    finished: bool  # the job's final or error event arrived (else the job is aborted when the stream stops)


async def job_chunks(
    svc: CompletionService, prep: PreparedRequest, sub: Subscription | None, cached: JobResult | None = None
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunk bodies of one job's OpenAI stream, an error body last if it fails (also when Redis fails
    under it, or anything else: a stream never just stops); a job not finished when the consumer stops is
    aborted."""
    fmt = formatter_for(svc, prep)
    state = _Progress(finished=sub is None)
    try:
        for chunk in fmt.start_chunks(prep.n):
            yield chunk
        if cached is not None:  # the stored answer, streamed as its deltas then its final event
            for delta in replay_deltas(cached, svc.tokenizer, prep.params.skip_special_tokens):
                for chunk in fmt.delta_chunks(delta):
                    yield chunk
            for chunk in fmt.final_chunks(FinalEvent(0, cached), prep.include_usage):
                yield chunk
            return
        assert sub is not None
        async for chunk in _relayed_chunks(svc, prep, sub, fmt, state):
            yield chunk
    except (RedisError, OSError) as exc:
        logger.warning("stream %s: Redis failed under it (%s)", prep.request_id, exc)
        svc.metrics.errors.labels("503").inc()
        yield error_body(REDIS_DOWN_MESSAGE, "service_unavailable", code="redis_unavailable")
    except Exception:
        logger.exception("stream %s failed", prep.request_id)
        svc.metrics.errors.labels("500").inc()
        yield error_body("internal server error", "server_error")
    finally:
        if sub is not None:
            svc.spawn(_release(svc, sub, abort=not state.finished))


async def _relayed_chunks(
    svc: CompletionService, prep: PreparedRequest, sub: Subscription, fmt: ResponseFormatter, state: _Progress
) -> AsyncGenerator[dict[str, Any], None]:
    last = None
    async for ev in svc.relay.events(sub, timeout_s=svc.settings.request_timeout_s, merge=True):
        now = time.monotonic()
        if ev.kind == "delta":
            svc.metrics.ttft.observe(now - prep.arrival) if last is None else svc.metrics.itl.observe(now - last)
            last = now
            for chunk in fmt.delta_chunks(ev):
                yield chunk
        elif isinstance(ev, FinalEvent):
            state.finished = True
            _observe_final(svc, prep, ev.result)
            await _remember(svc, prep, ev.result)
            for chunk in fmt.final_chunks(ev, prep.include_usage):
                yield chunk
        elif isinstance(ev, ErrorEvent):
            state.finished = True
            svc.metrics.errors.labels(str(ev.status)).inc()
            yield error_body(ev.message, ev.type, code=ev.code)


async def _release(svc: CompletionService, sub: Subscription, abort: bool) -> None:
    """``svc.release`` in the background; with Redis away the abort is logged, not raised into the void."""
    try:
        await svc.release(sub, abort)
    except (RedisError, OSError) as exc:
        logger.warning("could not release %s: %s", sub.job_id, exc)


async def _remember(svc: CompletionService, prep: PreparedRequest, result: JobResult) -> None:
    """Cache the answer, if Redis takes it: the client gets its answer either way."""
    try:
        await svc.remember(prep, result)
    except (RedisError, OSError) as exc:
        logger.warning("could not cache %s: %s", prep.request_id, exc)


async def openai_stream(
    svc: CompletionService, prep: PreparedRequest, sub: Subscription | None, cached: JobResult | None = None
) -> AsyncIterator[str]:
    """``data:`` payloads of an OpenAI stream, ``[DONE]`` last."""
    chunks = job_chunks(svc, prep, sub, cached)
    try:
        async for chunk in chunks:
            yield _dumps(chunk)
        yield DONE
    finally:
        await chunks.aclose()  # at once, not at garbage collection: a client that left gets its job aborted


def parse_last_event_id(value: str | None) -> tuple[int, int]:
    """``"<seq>.<chunk>"`` → (seq, chunk); (-1, -1) when absent or malformed (start from the beginning)."""
    if not value:
        return -1, -1
    seq, _, chunk = value.strip().partition(".")
    try:
        return int(seq), int(chunk) if chunk else 1 << 30
    except ValueError:
        return -1, -1


def _event_chunks(fmt: ResponseFormatter, ev: Event, n: int, include_usage: bool) -> list[str]:
    if ev.kind == "delta":
        chunks = fmt.delta_chunks(ev)  # type: ignore[arg-type]
    elif isinstance(ev, FinalEvent):
        chunks = fmt.final_chunks(ev, include_usage)
    else:
        assert isinstance(ev, ErrorEvent)
        chunks = [error_body(ev.message, ev.type, code=ev.code)]
    if ev.seq == 0:
        chunks = fmt.start_chunks(n) + chunks
    return [_dumps(c) for c in chunks]


async def job_event_stream(
    svc: CompletionService, job_id: str, meta: JobMeta, sub: Subscription, last_event_id: str | None
) -> AsyncIterator[ServerSentEvent]:
    """EventSource stream of a job. Each SSE id is ``<seq>.<chunk>``; on resume, events up to Last-Event-ID are
    replayed into the formatter silently so the rest is sent exactly once. Leaving does not abort the job. If
    Redis fails under it, an error event (no id: resuming later may still work) and ``[DONE]`` end it."""
    try:
        async for event in _job_events(svc, job_id, meta, sub, last_event_id):
            yield event
    except (RedisError, OSError) as exc:
        logger.warning("job events %s: Redis failed under the stream (%s)", job_id, exc)
        yield ServerSentEvent(_dumps(error_body(REDIS_DOWN_MESSAGE, "service_unavailable", code="redis_unavailable")))
        yield ServerSentEvent(DONE)
    finally:
        svc.spawn(svc.relay.unsubscribe(sub))


async def _job_events(
    svc: CompletionService, job_id: str, meta: JobMeta, sub: Subscription, last_event_id: str | None
) -> AsyncIterator[ServerSentEvent]:
    fmt = ResponseFormatter(meta.kind, job_id, meta.model, meta.created, svc.tokenizer, meta.echo)
    n, include_usage = meta.n, meta.include_usage
    last_seq, last_chunk = parse_last_event_id(last_event_id)
    history = await svc.relay.read_events(job_id, 0)
    replay = [ev for ev in history if ev.seq <= last_seq]
    for ev in replay:
        chunks = _event_chunks(fmt, ev, n, include_usage)
        if ev.seq == last_seq:
            for j, data in enumerate(chunks[last_chunk + 1 :], start=last_chunk + 1):
                yield ServerSentEvent(data, id=f"{ev.seq}.{j}")
        if ev.kind != "delta":
            yield ServerSentEvent(DONE)
            return
    events = svc.relay.events(sub, from_seq=last_seq + 1, timeout_s=svc.settings.request_timeout_s, catch_up=True)
    async for ev in events:
        for j, data in enumerate(_event_chunks(fmt, ev, n, include_usage)):
            yield ServerSentEvent(data, id=f"{ev.seq}.{j}")
    yield ServerSentEvent(DONE)
