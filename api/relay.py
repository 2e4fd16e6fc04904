"""Job events from Redis to the HTTP handlers: one pub/sub connection per API process, routing each job's
channel to a local queue, and an iterator that turns the pub/sub stream into a gap-free, duplicate-free
sequence by reading the job's events list (index == seq) whenever a seq is skipped or the channel is quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from wire import keys
from wire.messages import ErrorEvent, Event, decode_event

logger = logging.getLogger(__name__)

_CONTROL_CHANNEL = f"{keys.PREFIX}:relay"  # subscribed at start so the pub/sub connection always exists


@dataclass(eq=False)  # hashed by identity: one per reader
class Subscription:
    job_id: str
    queue: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)


class EventRelay:
    """Owns the process's pub/sub connection. ``subscribe`` returns once Redis confirmed the subscription,
    so a job enqueued afterwards cannot publish before we listen."""

    def __init__(self, redis: Redis, idle_poll_s: float = 1.0) -> None:
        self._redis = redis
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self._subs: dict[bytes, set[Subscription]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self.idle_poll_s = idle_poll_s

    async def start(self) -> None:
        self._pubsub = self._redis.pubsub()
        await self._pubsub.subscribe(_CONTROL_CHANNEL)
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
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                # readers fall back to polling the events lists until the connection is back
                logger.warning("pub/sub connection lost (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            if msg is None:
                continue
            channel = msg["channel"]
            if msg["type"] == "message":
                for sub in self._subs.get(channel, ()):
                    sub.queue.put_nowait(msg["data"])
            elif msg["type"] == "subscribe" and channel in self._confirmed:
                self._confirmed[channel].set()

    async def subscribe(self, job_id: str, timeout_s: float = 5.0) -> Subscription:
        assert self._pubsub is not None, "EventRelay.start() first"
        channel = keys.stream_channel(job_id).encode()
        sub = Subscription(job_id)
        subs = self._subs.setdefault(channel, set())
        subs.add(sub)
        if len(subs) == 1:
            confirmed = self._confirmed[channel] = asyncio.Event()
            try:
                await self._pubsub.subscribe(channel)
                await asyncio.wait_for(confirmed.wait(), timeout_s)
            except BaseException:
                self._drop(channel, sub)
                raise
            finally:
                self._confirmed.pop(channel, None)
        return sub

    def _drop(self, channel: bytes, sub: Subscription) -> bool:
        subs = self._subs.get(channel)
        if subs is None:
            return False
        subs.discard(sub)
        if subs:
            return False
        del self._subs[channel]
        return True

    async def unsubscribe(self, sub: Subscription) -> None:
        channel = keys.stream_channel(sub.job_id).encode()
        if self._drop(channel, sub) and self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.unsubscribe(channel)

    async def read_events(self, job_id: str, from_seq: int) -> list[Event]:
        raw = await self._redis.lrange(keys.events_key(job_id), from_seq, -1)  # type: ignore[misc]
        return [decode_event(r) for r in raw]

    async def events(
        self, sub: Subscription, from_seq: int = 0, timeout_s: float = 600.0, catch_up: bool = False
    ) -> AsyncIterator[Event]:
        """Events of the job from ``from_seq`` on, in order, each once, ending after the final or error event."""
        next_seq = from_seq
        deadline = time.monotonic() + timeout_s
        pending: list[Event] = await self.read_events(sub.job_id, next_seq) if catch_up else []
        while True:
            for ev in pending:
                if ev.seq != next_seq:  # an older duplicate, or (never expected) a gap in the list itself
                    continue
                yield ev
                next_seq += 1
                if ev.kind != "delta":
                    return
            pending = []
            try:
                raw = await asyncio.wait_for(sub.queue.get(), self.idle_poll_s)
            except TimeoutError:
                pending = await self.read_events(sub.job_id, next_seq)
                if not pending and time.monotonic() > deadline:
                    yield ErrorEvent(next_seq, f"no result within {timeout_s:.0f} s", "timeout", "timeout", 504)
                    return
                continue
            ev = decode_event(raw)
            if ev.seq == next_seq:
                pending = [ev]
            elif ev.seq > next_seq:  # missed some: the list has everything up to this one
                pending = await self.read_events(sub.job_id, next_seq)
