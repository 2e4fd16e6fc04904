"""Writing job events: the worker's side of the seq protocol (also drives API tests without an engine).

``EventBatch`` gathers the events of many jobs (a worker gathers one engine step's) and writes them in ONE
round trip (a Lua script): each event is appended to its job's list (index == seq) before the batch's publishes run, so a
subscriber that receives seq k can always read 0..k from the list. Events bound for one channel go out as
one message, a JSON array of ``[job_id, event]`` pairs (``decode_batch``): an API process gets one message
per step for all its streams instead of one per stream.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from wire import keys
from wire.messages import (
    ChoiceDelta,
    DeltaEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    JobResult,
    encode_event,
    event_from_obj,
)

_quoted = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # a JSON string literal, in C


def decode_batch(raw: bytes | str) -> list[tuple[str, Event]]:
    """A published batch message → its (job id, event) pairs."""
    return [(str(job_id), event_from_obj(obj)) for job_id, obj in json.loads(raw)]


@dataclass
class EventBatch:
    """Events of many jobs, written together by ``execute``."""

    _writes: list[tuple[str, Event, str, int, str | None]] = field(default_factory=list)

    def add(self, job_id: str, event: Event, ttl_s: int, channel: str | None) -> None:
        """``channel`` None: stored, not published (a non-streaming job's deltas are not even stored)."""
        self._writes.append((job_id, event, encode_event(event), ttl_s, channel))

    def __len__(self) -> int:
        return len(self._writes)

    async def execute(self, redis: Redis) -> None:
        """One round trip: a Lua script appends every event to its list and sets TTLs, then publishes.
        Keys, TTLs and event lengths travel as one JSON argument (Redis' Lua has cjson), all the events as ONE
        plain argument that the script cuts by length: redis-py packs each argument separately (~25 us each on a
        busy host), which made one argument per event the front's top Redis cost at 512 streams. (Building each
        channel's message inside the script instead of sending the events twice was slower: 9.8 against 5.5-6.3
        ms of script time for 256 final events on the 2-core VM.)"""
        if not self._writes:
            return
        appends: list[list[str | int]] = []
        events: list[str] = []
        published: dict[str, list[str]] = {}
        for job_id, event, data, ttl_s, channel in self._writes:
            expire = ttl_s if event.seq == 0 or event.kind != "delta" else 0
            size = len(data) if data.isascii() else len(data.encode())  # (the encoders write ASCII JSON)
            appends.append([keys.events_key(job_id), expire, size])
            events.append(data)
            if channel is not None:
                published.setdefault(channel, []).append(f"[{_quoted(job_id)},{data}]")
        args: list[str] = [json.dumps(appends), "".join(events)]
        for channel, items in published.items():
            args += [channel, "[" + ",".join(items) + "]"]
        await _run_script(redis, args)
        self._writes = []  # only once written: a batch whose write failed can be executed again


# ARGV: [[events key, ttl or 0, event length], ...], the events back to back, then (channel, message) pairs. Lists
# are appended before anything is published, so a subscriber that gets seq k can read 0..k. (Keys and TTLs go as
# JSON; the events as one plain argument, not escaped twice.) A job's answer is its list's last event (its final):
# no second copy of it is stored, so a wave's end, when every stream's final goes out within a few steps, writes
# each answer once to the list (and the append-only file) instead of twice.
_WRITE_SCRIPT = """
local appends = cjson.decode(ARGV[1])
local blob = ARGV[2]
local pos = 1
for _, w in ipairs(appends) do
  redis.call('RPUSH', w[1], string.sub(blob, pos, pos + w[3] - 1))
  pos = pos + w[3]
  if w[2] > 0 then redis.call('EXPIRE', w[1], w[2]) end
end
for i = 3, #ARGV, 2 do
  redis.call('PUBLISH', ARGV[i], ARGV[i + 1])
end
return #appends
"""


_WRITE_SHA = hashlib.sha1(_WRITE_SCRIPT.encode()).hexdigest()


async def _run_script(redis: Redis, args: list[str]) -> None:
    """EVALSHA (the script text is sent only when this Redis has not seen it yet)."""
    try:
        await redis.evalsha(_WRITE_SHA, 0, *args)  # type: ignore[misc, arg-type]
    except NoScriptError:
        await redis.eval(_WRITE_SCRIPT, 0, *args)  # type: ignore[misc, arg-type]


class JobEventWriter:
    """Numbers and writes the events of one job, one at a time. The worker running the job is its only writer."""

    def __init__(
        self,
        redis: Redis,
        job_id: str,
        ttl_s: int,
        publish_deltas: bool = True,
        next_seq: int = 0,
        channel: str = "",
    ) -> None:
        self._redis = redis
        self.job_id = job_id
        self.ttl_s = ttl_s
        self.publish_deltas = publish_deltas
        self.next_seq = next_seq
        self.channel = channel or keys.stream_channel(job_id)

    async def _write(self, event: Event, publish: bool = True) -> None:
        batch = EventBatch()
        batch.add(self.job_id, event, self.ttl_s, self.channel if publish else None)
        await batch.execute(self._redis)
        self.next_seq += 1

    async def delta(self, choices: list[ChoiceDelta], publish: bool = True) -> None:
        """New text of some choices. Not written at all for a non-streaming job (it only needs the result)."""
        if self.publish_deltas:
            await self._write(DeltaEvent(self.next_seq, choices), publish)

    async def final(self, result: JobResult, streamed: bool = False) -> None:
        """``streamed``: ``result``'s choices hold only what the deltas did not (``FinalEvent.streamed``)."""
        await self._write(FinalEvent(self.next_seq, result, streamed=streamed))

    async def error(self, message: str, type: str = "server_error", code: str | None = None, status: int = 500) -> None:
        await self._write(ErrorEvent(self.next_seq, message, type, code, status))
