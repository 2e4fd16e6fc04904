"""HTTP framing of a job's events: the non-streaming body, OpenAI SSE (``data: {chunk}`` … ``data: [DONE]``),
and the EventSource stream of /v1/jobs/{id}/events (``id:`` on every event, resume from Last-Event-ID)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError
from sse_starlette import ServerSentEvent
from starlette.requests import Request

from api.errors import ApiError, error_body
from api.formatting import ResponseFormatter, dumps_chunk, replay_deltas
from api.relay import Subscription
from api.service import CompletionService, PreparedRequest
from wire.messages import DeltaEvent, ErrorEvent, Event, FinalEvent, JobMeta, JobResult, assemble

T = TypeVar("T")
DONE = "[DONE]"
REDIS_DOWN_MESSAGE = "the job queue (Redis) failed under this request; its outcome is unknown: retry it"
logger = logging.getLogger(__name__)


# PAGEDSERVE_SSE_TIMES=1 (``pagedserve bench stack`` sets it): each write of a stream starts with an SSE comment
# ``: t <relay receipt> <write>`` (time.perf_counter(), CLOCK_MONOTONIC on Linux: comparable with the client's
# clock on the same host), so the bench can tell where a long gap between chunks arose. SSE clients ignore comments.
SSE_TIMES = os.environ.get("PAGEDSERVE_SSE_TIMES") == "1"


def sse_frames(payloads: list[str]) -> bytes:
    """``data: <payload>`` events, as sent (OpenAI's streams have no ``id:`` or ``event:`` lines)."""
    return "".join([f"data: {p}\n\n" for p in payloads]).encode()


DONE_FRAME = sse_frames([DONE])


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

    deltas: list[DeltaEvent] = []  # none for a non-streaming job; kept should a streamed final come anyway

    async def final() -> Event:
        async for ev in svc.relay.events(sub, timeout_s=svc.settings.request_timeout_s):
            if not isinstance(ev, DeltaEvent):
                return ev
            deltas.append(ev)
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
    result = assemble(ev, deltas)
    _observe_final(svc, prep, result)
    await _remember(svc, prep, result)
    return result


async def _rendered(
    svc: CompletionService,
    prep: PreparedRequest,
    sub: Subscription | None,
    cached: JobResult | None,
    render: Callable[[list[Event]], T],
) -> AsyncGenerator[T, None]:
    """``render`` of each batch of a job's events for its OpenAI stream, as the relay hands them over
    (``EventRelay.batches``: deltas that queued up merged), with the metrics and the cache seen to; of an error
    event last if it fails (also when Redis fails under it, or anything else: a stream never just stops). A job
    not finished when the consumer stops is aborted."""
    finished, next_seq = sub is None, 0
    try:
        if cached is not None:  # the stored answer, streamed as its deltas then its final event
            replayed = replay_deltas(cached, svc.tokenizer, prep.params.skip_special_tokens)
            yield render([*replayed, FinalEvent(len(replayed), cached)])
            return
        assert sub is not None
        last = None
        deltas: list[DeltaEvent] = []  # the answer so far: a streamed final carries only what they did not
        async for batch in svc.relay.batches(sub, timeout_s=svc.settings.request_timeout_s, merge=True):
            now = time.monotonic()
            for ev in batch:
                if isinstance(ev, DeltaEvent):
                    metric, since = (svc.metrics.ttft, prep.arrival) if last is None else (svc.metrics.itl, last)
                    metric.observe(now - since)
                    last = now
                    deltas.append(ev)
                elif isinstance(ev, FinalEvent):
                    finished = True
                    result = assemble(ev, deltas)
                    _observe_final(svc, prep, result)
                    await _remember(svc, prep, result)
                elif isinstance(ev, ErrorEvent):
                    finished = True
                    svc.metrics.errors.labels(str(ev.status)).inc()
            next_seq = batch[-1].seq + 1
            yield render(batch)
    except (RedisError, OSError) as exc:
        logger.warning("stream %s: Redis failed under it (%s)", prep.request_id, exc)
        svc.metrics.errors.labels("503").inc()
        yield render([ErrorEvent(next_seq, REDIS_DOWN_MESSAGE, "service_unavailable", "redis_unavailable", 503)])
    except Exception:
        logger.exception("stream %s failed", prep.request_id)
        svc.metrics.errors.labels("500").inc()
        yield render([ErrorEvent(next_seq, "internal server error", "server_error")])
    finally:
        if sub is not None:
            svc.spawn(_release(svc, sub, abort=not finished))


def _event_bodies(fmt: ResponseFormatter, ev: Event, include_usage: bool) -> list[dict[str, Any]]:
    if isinstance(ev, DeltaEvent):
        return fmt.delta_chunks(ev)
    if isinstance(ev, FinalEvent):
        return fmt.final_chunks(ev, include_usage)
    return [error_body(ev.message, ev.type, code=ev.code)]


def _event_json(fmt: ResponseFormatter, ev: Event, include_usage: bool) -> list[str]:
    """``_event_bodies`` as JSON texts; a delta's from the formatter's template."""
    if isinstance(ev, DeltaEvent):
        return fmt.delta_json(ev)
    return [dumps_chunk(c) for c in _event_bodies(fmt, ev, include_usage)]


async def job_chunks(
    svc: CompletionService, prep: PreparedRequest, sub: Subscription | None, cached: JobResult | None = None
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunk bodies of one job's OpenAI stream, an error body last if it fails (``_rendered``)."""
    fmt = formatter_for(svc, prep)
    for chunk in fmt.start_chunks(prep.n):
        yield chunk

    def render(batch: list[Event]) -> list[dict[str, Any]]:
        return [chunk for ev in batch for chunk in _event_bodies(fmt, ev, prep.include_usage)]

    rendered = _rendered(svc, prep, sub, cached, render)
    try:
        async for chunks in rendered:
            for chunk in chunks:
                yield chunk
    finally:
        await rendered.aclose()  # at once, not at garbage collection: a client that left gets its job aborted


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
) -> AsyncIterator[bytes]:
    """The SSE bytes of an OpenAI stream, ``data: [DONE]`` last: the chunks of events that came together in one
    write (one ASGI send), a delta's JSON from the formatter's template."""
    fmt = formatter_for(svc, prep)
    start = fmt.start_chunks(prep.n)
    if start:
        yield sse_frames([dumps_chunk(c) for c in start])

    def render(batch: list[Event]) -> bytes:
        frames = sse_frames([text for ev in batch for text in _event_json(fmt, ev, prep.include_usage)])
        if SSE_TIMES and sub is not None:  # benchmarks: when the relay got the batch and when it went out
            return f": t {sub.pushed_at:.6f} {time.perf_counter():.6f}\n".encode() + frames
        return frames

    rendered = _rendered(svc, prep, sub, cached, render)
    try:
        async for frames in rendered:
            if frames:
                yield frames
        yield DONE_FRAME
    finally:
        await rendered.aclose()  # at once, not at garbage collection: a client that left gets its job aborted


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
    """An event's chunks as JSON texts, the stream's start chunks first on the job's first event."""
    texts = _event_json(fmt, ev, include_usage)
    return [dumps_chunk(c) for c in fmt.start_chunks(n)] + texts if ev.seq == 0 else texts


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
        body = error_body(REDIS_DOWN_MESSAGE, "service_unavailable", code="redis_unavailable")
        yield ServerSentEvent(dumps_chunk(body))
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
