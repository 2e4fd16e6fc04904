"""Job events from Redis to the HTTP handlers: one pub/sub connection per API process, routing each job's
events to a local queue, and an iterator that turns the pub/sub stream into a gap-free, duplicate-free
sequence by reading the job's events list (index == seq) whenever a seq is skipped or the channel is quiet.

Jobs this process enqueued for its own OpenAI responses name its ``reply_channel``: workers publish one
message per engine step there, holding the events of all such jobs, so no per-job subscription (and no
round trip before enqueueing) is needed. Jobs that any API process may follow (/v1/jobs EventSource) use
their own channel, subscribed on demand.

Redis outages: the pub/sub connection reconnects (and resubscribes) with a backoff, and readers read the
events lists as usual once Redis answers again. A reader that cannot read them for ``outage_s`` ends with a
``redis_unavailable`` error event, and one whose job Redis came back without (or whose events it lost) with
``job_lost``: a stream is never cut silently, nor left waiting for events that will not come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from wire import keys
from wire.messages import ChoiceDelta, DeltaEvent, ErrorEvent, Event, decode_event
from wire.publisher import decode_batch

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # hashed by identity: one per reader
class Subscription:
    """One reader's events of a job, pushed by the relay as they are routed and taken by the reader."""

    job_id: str
    own_channel: bool  # subscribed to the job's own channel (else it comes through the reply channel)
    _pending: deque[Event] = field(default_factory=deque)
    _waiter: asyncio.Future[None] | None = None
    _waiting_since: float = 0.0  # loop time
    _timer: asyncio.TimerHandle | None = None
    pushed_at: float = 0.0  # time.perf_counter() of the last push (the relay's receipt: SSE_TIMES)

    def push(self, event: Event) -> None:
        self._pending.append(event)
        self.pushed_at = time.perf_counter()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self, idle_s: float) -> list[Event]:
        """What was pushed since the last take, once there is something; [] after ``idle_s`` without (a quiet
        channel). A wait has no timer of its own (``asyncio.timeout`` per wait cost more than the rest of an
        event's trip through the relay): one per reader, due ``idle_s`` after the wait that set it, moves on
        to the current wait's deadline when it finds the reader has been woken since."""
        if not self._pending:
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            self._waiting_since = loop.time()
            if self._timer is None:
                self._timer = loop.call_at(self._waiting_since + idle_s, self._check_idle, idle_s)
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = list(self._pending)
        self._pending.clear()
        return events

    def _check_idle(self, idle_s: float) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():  # not waiting: the next wait sets a timer
            return
        loop = asyncio.get_running_loop()
        due = self._waiting_since + idle_s
        if loop.time() >= due:
            self._waiter.set_result(None)
        else:
            self._timer = loop.call_at(due, self._check_idle, idle_s)


class EventRelay:
    """Owns the process's pub/sub connection. ``subscribe`` returns once Redis confirmed the subscription,
    so a job enqueued afterwards cannot publish before we listen."""

    def __init__(self, redis: Redis, idle_poll_s: float = 1.0, outage_s: float = 30.0) -> None:
        self._redis = redis
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self._subs: dict[str, set[Subscription]] = {}  # job id -> its readers in this process
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self.idle_poll_s = idle_poll_s
        self.outage_s = outage_s  # a reader gives up after Redis has not answered it this long
        self.num_outages = 0  # times the pub/sub connection was lost: readers then check that their job survived
        self.reply_channel = f"{keys.PREFIX}:reply:{uuid.uuid4().hex}"
        self.num_events = 0  # events routed (all jobs)

    async def start(self) -> None:
        self._pubsub = self._redis.pubsub()
        await self._pubsub.subscribe(self.reply_channel)
        self._task = asyncio.create_task(self._reader(), name="event-relay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()

    async def _reader(self) -> None:
        assert self._pubsub is not None
        delay = 0.0
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                # readers fall back to polling the events lists until the connection is back
                if delay == 0.0:
                    self.num_outages += 1
                    logger.warning("pub/sub connection lost (%s); reconnecting", exc)
                delay = min(2.0, max(0.05, 2 * delay))
                await asyncio.sleep(delay)
                continue
            if delay:
                logger.warning("pub/sub connection back")
                delay = 0.0
            if msg is None:
                continue
            channel = msg["channel"]
            if msg["type"] == "message":
                self._route(msg["data"])
            elif msg["type"] == "subscribe" and channel in self._confirmed:
                self._confirmed[channel].set()

    def _route(self, raw: bytes) -> None:
        try:
            items = decode_batch(raw)
        except (ValueError, KeyError, TypeError) as exc:  # readers recover from the events lists
            logger.warning("dropped a malformed event batch: %s", exc)
            return
        self.num_events += len(items)
        for job_id, event in items:
            for sub in self._subs.get(job_id, ()):
                sub.push(event)

    async def subscribe(self, job_id: str, own_channel: bool = True, timeout_s: float = 5.0) -> Subscription:
        """Start receiving a job's events. ``own_channel`` False: the job publishes to ``reply_channel``."""
        assert self._pubsub is not None, "EventRelay.start() first"
        sub = Subscription(job_id, own_channel)
        self._subs.setdefault(job_id, set()).add(sub)
        if own_channel and not any(s.own_channel for s in self._subs[job_id] if s is not sub):
            channel = keys.stream_channel(job_id).encode()
            confirmed = self._confirmed[channel] = asyncio.Event()
            try:
                await self._pubsub.subscribe(channel)
                await asyncio.wait_for(confirmed.wait(), timeout_s)
            except BaseException:
                await self.unsubscribe(sub)
                raise
            finally:
                self._confirmed.pop(channel, None)
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.job_id)
        if subs is None or sub not in subs:
            return
        subs.discard(sub)
        if not subs:
            del self._subs[sub.job_id]
        if sub.own_channel and not any(s.own_channel for s in subs) and self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.unsubscribe(keys.stream_channel(sub.job_id))

    async def read_events(self, job_id: str, from_seq: int) -> list[Event]:
        raw = await self._redis.lrange(keys.events_key(job_id), from_seq, -1)  # type: ignore[misc]
        return [decode_event(r) for r in raw]

    async def _read_or_error(self, job_id: str, from_seq: int, check_job: bool = False) -> list[Event]:
        """``read_events``, retried with a backoff while Redis does not answer; an error event (numbered
        ``from_seq``) instead when it stays away ``outage_s``, or comes back without the job."""
        failed_at: float | None = None
        delay = 0.05
        while True:
            try:
                events = await self.read_events(job_id, from_seq)
                if (failed_at is not None or check_job) and not events and not await self._job_exists(job_id):
                    return [_lost(from_seq, "Redis restarted without it")]
                return events
            except (RedisError, OSError) as exc:
                now = time.monotonic()
                failed_at = failed_at or now
                if now - failed_at >= self.outage_s:
                    message = f"the job queue (Redis) has been unavailable for {self.outage_s:.0f} s ({exc}); retry"
                    return [ErrorEvent(from_seq, message, "service_unavailable", "redis_unavailable", 503)]
                await asyncio.sleep(delay)
                delay = min(1.0, 2 * delay)

    async def _job_exists(self, job_id: str) -> bool:
        """Queued or running (arq's job key) or with events: anything else was lost with Redis' data."""
        return bool(await self._redis.exists(keys.ARQ_JOB_PREFIX + job_id, keys.events_key(job_id)))

    async def events(
        self,
        sub: Subscription,
        from_seq: int = 0,
        timeout_s: float = 600.0,
        catch_up: bool = False,
        merge: bool = False,
    ) -> AsyncIterator[Event]:
        """Events of the job from ``from_seq`` on, in order, each once, ending after the final or error event.
        ``merge``: deltas that queued up while the reader was busy come out as one (a slow client gets fewer,
        larger chunks instead of falling further behind); their seq is the last one's."""
        async for batch in self.batches(sub, from_seq, timeout_s, catch_up, merge):
            for ev in batch:
                yield ev

    async def batches(
        self,
        sub: Subscription,
        from_seq: int = 0,
        timeout_s: float = 600.0,
        catch_up: bool = False,
        merge: bool = False,
    ) -> AsyncIterator[list[Event]]:
        """``events``, as the lists that were ready together (never empty): a stream writes each in one send."""
        next_seq = from_seq
        deadline = time.monotonic() + timeout_s
        pending: list[Event] = await self._read_or_error(sub.job_id, next_seq) if catch_up else []
        num_outages = self.num_outages
        while True:
            ready: list[Event] = []
            gap = False
            for ev in pending:
                if ev.seq < next_seq:  # an older duplicate
                    continue
                if ev.seq > next_seq:  # missed some: the list has everything up to this one
                    gap = True
                    break
                ready.append(ev)
                next_seq += 1
                if ev.kind != "delta":
                    break
            if ready:
                yield merge_deltas(ready) if merge else ready
                if ready[-1].kind != "delta":
                    return
            if gap:
                pending = await self._read_or_error(sub.job_id, next_seq)
                if not any(ev.seq == next_seq for ev in pending):  # the list is written first: it was lost
                    pending = [_lost(next_seq, "Redis lost some of its events")]
                continue
            pending = await sub.take(self.idle_poll_s)  # all that queued up: merged, or yielded one by one
            if not pending:  # quiet for idle_poll_s: read the list (a lost message, Redis back after an outage)
                check_job, num_outages = num_outages != self.num_outages, self.num_outages
                pending = await self._read_or_error(sub.job_id, next_seq, check_job)
                if not pending and time.monotonic() > deadline:
                    yield [ErrorEvent(next_seq, f"no result within {timeout_s:.0f} s", "timeout", "timeout", 504)]
                    return


def _lost(seq: int, why: str) -> ErrorEvent:
    return ErrorEvent(seq, f"the request was lost ({why}); retry it", "server_error", "job_lost", 503)


def merge_deltas(events: list[Event]) -> list[Event]:
    """Consecutive delta events as one (per choice: text, token ids and logprobs joined); others as they are."""
    if len(events) == 1:
        return events
    merged: list[Event] = []
    run: list[DeltaEvent] = []
    for ev in events:
        if isinstance(ev, DeltaEvent):
            run.append(ev)
            continue
        if run:
            merged.append(_join(run))
            run = []
        merged.append(ev)
    if run:
        merged.append(_join(run))
    return merged


def _join(run: list[DeltaEvent]) -> DeltaEvent:
    """One delta for several: each choice's pieces joined once (linear in the backlog, not quadratic)."""
    if len(run) == 1:
        return run[0]
    pieces: dict[int, list[ChoiceDelta]] = {}
    for ev in run:
        for c in ev.choices:
            pieces.setdefault(c.index, []).append(c)
    choices = []
    for index, cs in pieces.items():
        if len(cs) == 1:
            choices.append(cs[0])
            continue
        logprobs = None if all(c.logprobs is None for c in cs) else [lp for c in cs for lp in c.logprobs or ()]
        choices.append(ChoiceDelta(index, "".join(c.text for c in cs), [t for c in cs for t in c.token_ids], logprobs))
    return DeltaEvent(run[-1].seq, choices)
