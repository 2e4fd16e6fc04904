"""Jobs no worker started before their queue deadline leave the queue with the error their callers wait for.

Workers drop a job that starts late themselves, but with no worker running (all busy on long jobs, all dead,
none deployed yet) nobody would, and the caller would wait for its request timeout. Every API process sweeps
the queue twice a second; one atomic script removes a job only if it never started (no in-progress marker
and no retry counter: a job whose worker died keeps its place for the next worker), so of several API
processes exactly one writes the error event, which reaches the caller through the job's events as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

from wire import keys
from wire.publisher import JobEventWriter

logger = logging.getLogger(__name__)

_DROP_IF_NEVER_STARTED = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if removed == 1 then redis.call('DEL', KEYS[4]) end
return removed
"""


class QueueReaper:
    """Sweeps the queue for jobs enqueued more than ``deadline_s + grace_s`` ago that no worker started."""

    def __init__(
        self, redis: Redis, deadline_s: float, events_ttl_s: int, grace_s: float = 0.5, interval_s: float = 0.5
    ) -> None:
        self._redis = redis
        self._script = redis.register_script(_DROP_IF_NEVER_STARTED)
        self.deadline_s = deadline_s
        self.events_ttl_s = events_ttl_s
        self.grace_s = grace_s  # a worker that takes a job right at its deadline drops it itself
        self.interval_s = interval_s
        self.num_expired = 0

    async def sweep(self) -> list[str]:
        """One pass; returns the ids of the jobs it dropped."""
        cutoff_ms = int((time.time() - self.deadline_s - self.grace_s) * 1000)
        candidates = await self._redis.zrangebyscore(keys.QUEUE, "-inf", cutoff_ms, start=0, num=1000)
        dropped = []
        for raw in candidates:
            job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            job_keys = [
                keys.QUEUE,
                keys.ARQ_IN_PROGRESS_PREFIX + job_id,
                keys.ARQ_RETRY_PREFIX + job_id,
                keys.ARQ_JOB_PREFIX + job_id,
            ]
            if not await self._script(keys=job_keys, args=[job_id]):
                continue
            writer = JobEventWriter(self._redis, job_id, self.events_ttl_s)
            await writer.error(
                f"no worker started the request within its {self.deadline_s:.0f} s queue deadline; retry later",
                "timeout",
                "queue_deadline_exceeded",
                503,
            )
            dropped.append(job_id)
        self.num_expired += len(dropped)
        return dropped

    async def run(self) -> None:
        while True:
            try:
                dropped = await self.sweep()
                if dropped:
                    logger.warning("dropped %d jobs no worker started within %.0f s", len(dropped), self.deadline_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis hiccups must not end the sweeping
                logger.warning("queue sweep failed: %s", exc)
            await asyncio.sleep(self.interval_s)
