"""The job queue as the API sees it: enqueue (arq, JSON, job id = request id), backpressure, abort, and the
live workers' heartbeats (for /ready, queue depth and /metrics)."""

from __future__ import annotations

import math
import time

from arq.connections import ArqRedis

from api.errors import ApiError
from wire import keys
from wire.messages import JobMeta, JobPayload, WorkerHeartbeat


class JobQueue:
    """Thin layer over arq's queue. Heartbeats are read at most every ``cache_s`` seconds."""

    def __init__(self, redis: ArqRedis, max_queue_depth: int, retry_after_s: int, worker_ttl_s: float) -> None:
        self._redis = redis
        self.max_queue_depth = max_queue_depth
        self.retry_after_s = retry_after_s
        self.worker_ttl_s = worker_ttl_s
        self._workers: list[WorkerHeartbeat] = []
        self._workers_at = 0.0
        self.cache_s = 0.5

    async def workers(self, fresh: bool = False) -> list[WorkerHeartbeat]:
        """Workers whose heartbeat is younger than ``worker_ttl_s``."""
        now = time.time()
        if not fresh and now - self._workers_at < self.cache_s:
            return self._workers
        ids = await self._redis.zrangebyscore(keys.WORKERS, now - self.worker_ttl_s, "+inf")
        beats: list[WorkerHeartbeat] = []
        if ids:
            raws = await self._redis.mget([keys.worker_key(i.decode()) for i in ids])
            beats = [WorkerHeartbeat.from_json(r) for r in raws if r is not None]
        self._workers, self._workers_at = beats, now
        return beats

    async def num_waiting(self) -> int:
        """Jobs in the queue not yet taken by a worker (arq keeps running jobs in the queue set too)."""
        queued = int(await self._redis.zcard(keys.QUEUE))
        running = sum(w.active_jobs for w in await self.workers())
        return max(0, queued - running)

    async def check_room(self) -> None:
        """429 with Retry-After when the queue is over its configured depth."""
        waiting = await self.num_waiting()
        if waiting < self.max_queue_depth:
            return
        capacity = sum(w.capacity for w in self._workers) or 1
        retry_after = max(self.retry_after_s, math.ceil(waiting / capacity) * self.retry_after_s)
        raise ApiError(
            429,
            f"the server is overloaded ({waiting} requests queued); retry after {retry_after} s",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after)},
        )

    async def enqueue(self, payload: JobPayload, meta: JobMeta) -> None:
        """Store what /v1/jobs/{id}/events needs to format the job, then queue it. arq drops a job nobody took
        long after its deadline; the worker drops one that starts past it (with an error event)."""
        ttl = payload.events_ttl_s
        await self._redis.set(keys.job_meta_key(payload.request_id), meta.to_json(), ex=ttl)
        job = await self._redis.enqueue_job(
            keys.JOB_FUNCTION,
            payload.to_dict(),
            _job_id=payload.request_id,
            _queue_name=keys.QUEUE,
            _expires=max(1.0, payload.deadline - time.time()) + 60.0,
        )
        if job is None:
            raise ApiError(409, f"a job with id {payload.request_id} already exists", code="duplicate_request_id")
        await self._redis.publish(keys.JOBS_CHANNEL, b"")  # wakes idle workers (they also poll)

    async def job_meta(self, job_id: str) -> JobMeta | None:
        """The job's stored meta; None when unknown or expired."""
        raw = await self._redis.get(keys.job_meta_key(job_id))
        return None if raw is None else JobMeta.from_json(raw)

    async def abort(self, job_id: str) -> None:
        """Ask the worker running (or about to run) this job to cancel it; it aborts the engine request."""
        await self._redis.zadd(keys.ARQ_ABORT_SET, {job_id: int(time.time() * 1000)})
