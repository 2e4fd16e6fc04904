"""Writing one job's events: the worker's side of the seq protocol (also drives API tests without an engine).

Each event is appended to the job's list (index == seq) and then published, in one MULTI/EXEC, so a
subscriber that receives seq k can always read 0..k from the list.
"""

from __future__ import annotations

from redis.asyncio import Redis

from wire import keys
from wire.messages import ChoiceDelta, DeltaEvent, ErrorEvent, Event, FinalEvent, JobResult, encode_event


class JobEventWriter:
    """Numbers and writes the events of one job. The worker running the job is its only writer."""

    def __init__(self, redis: Redis, job_id: str, ttl_s: int, publish_deltas: bool = True, next_seq: int = 0) -> None:
        self._redis = redis
        self.job_id = job_id
        self.ttl_s = ttl_s
        self.publish_deltas = publish_deltas
        self.next_seq = next_seq

    async def _write(self, event: Event, publish: bool = True) -> None:
        data = encode_event(event)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.rpush(keys.events_key(self.job_id), data)
            pipe.expire(keys.events_key(self.job_id), self.ttl_s)
            if publish:
                pipe.publish(keys.stream_channel(self.job_id), data)
            if isinstance(event, FinalEvent):
                pipe.set(keys.result_key(self.job_id), encode_event(event), ex=self.ttl_s)
            await pipe.execute()
        self.next_seq += 1

    async def delta(self, choices: list[ChoiceDelta], publish: bool = True) -> None:
        """New text of some choices. Not written at all for a non-streaming job (it only needs the result)."""
        if self.publish_deltas:
            await self._write(DeltaEvent(self.next_seq, choices), publish)

    async def final(self, result: JobResult) -> None:
        await self._write(FinalEvent(self.next_seq, result))

    async def error(self, message: str, type: str = "server_error", code: str | None = None, status: int = 500) -> None:
        await self._write(ErrorEvent(self.next_seq, message, type, code, status))
