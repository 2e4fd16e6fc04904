"""The job queue as the API sees it: admission (arq, JSON, job id = request id, with backpressure and the
live-worker check), abort, job meta, and the live workers' heartbeats (for /ready, queue depth and /metrics)."""

from __future__ import annotations

import asyncio
import math
import time

from arq.connections import ArqRedis

from api.admission import Admission
from api.errors import ApiError
from wire import keys
from wire.messages import JobMeta, JobPayload, WorkerHeartbeat


class JobQueue:
    """Thin layer over arq's queue. Heartbeats are read at most every ``cache_s`` seconds."""

    def __init__(
        self,
        redis: ArqRedis,
        max_queue_depth: int,
        retry_after_s: int,
        worker_ttl_s: float,
        queue_without_workers_s: float = 0.0,
    ) -> None:
        self._redis = redis
        self._admission = Admission(redis)
        self.max_queue_depth = max_queue_depth
        self.retry_after_s = retry_after_s
        self.worker_ttl_s = worker_ttl_s
        self.queue_without_workers_s = queue_without_workers_s
        self._workers: list[WorkerHeartbeat] = []
        self._workers_at = 0.0
        self._reading: asyncio.Future[list[WorkerHeartbeat]] | None = None  # the heartbeat read in flight
        self._live_at = time.time()  # when a live worker was last seen (or this process started)
        self.cache_s = 0.5

    async def workers(self, fresh: bool = False) -> list[WorkerHeartbeat]:
        """Workers whose heartbeat is younger than ``worker_ttl_s``. One read at a time: the requests of a burst
        that find the cache stale wait for the read in flight instead of each reading (on this VM 256 requests
        at once each made the two round trips: 6 % of the API's samples)."""
        if not fresh and time.time() - self._workers_at < self.cache_s:
            return self._workers
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_workers())
            self._reading.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if unawaited
        return await asyncio.shield(self._reading)  # a cancelled request does not cancel the others' read

    async def _read_workers(self) -> list[WorkerHeartbeat]:
        now = time.time()
        ids = await self._redis.zrangebyscore(keys.WORKERS, now - self.worker_ttl_s, "+inf")
        beats: list[WorkerHeartbeat] = []
        if ids:
            raws = await self._redis.mget([keys.worker_key(i.decode()) for i in ids])
            beats = [WorkerHeartbeat.from_json(r) for r in raws if r is not None]
        self._workers, self._workers_at = beats, now
        if any(not w.draining for w in beats):
            self._live_at = now
        return beats

    async def num_waiting(self) -> int:
        """Jobs in the queue not yet taken by a worker (arq keeps running jobs in the queue set too)."""
        queued = int(await self._redis.zcard(keys.QUEUE))
        running = sum(w.active_jobs for w in await self.workers())
        return max(0, queued - running)

    async def admit(self, payload: JobPayload, meta: JobMeta, cache_key: str | None = None) -> bytes | None:
        """Queue the job and its meta in one atomic round trip (``api.admission``), unless the response cache
        holds ``cache_key``: then its answer (JSON) is returned and nothing is queued. 503 with Retry-After when
        no worker has been live for ``queue_without_workers_s`` (a cached answer is still served then); 429 with
        Retry-After when the jobs waiting (the queue set less the jobs the workers' last heartbeats say they
        run) reach ``max_queue_depth``."""
        workers = await self.workers()  # cached: a round trip at most every cache_s
        is_live = any(not w.draining for w in workers)
        if not is_live and time.time() - self._live_at >= self.queue_without_workers_s:
            cached: bytes | None = await self._redis.get(cache_key) if cache_key else None
            if cached is not None:
                return cached
            raise ApiError(
                503,
                f"no worker is serving this model; retry after {self.retry_after_s} s",
                "service_unavailable",
                code="no_live_worker",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        running = sum(w.active_jobs for w in workers)
        admitted = await self._admission.admit(payload, meta, self.max_queue_depth + running, cache_key)
        if admitted.outcome == "cached":
            return admitted.cached
        if admitted.outcome == "duplicate":
            raise ApiError(409, f"a job with id {payload.request_id} already exists", code="duplicate_request_id")
        if admitted.outcome == "full":
            raise self._queue_full(admitted.queue_size - running, workers)
        return None

    def _queue_full(self, waiting: int, workers: list[WorkerHeartbeat]) -> ApiError:
        capacity = sum(w.capacity for w in workers) or 1
        retry_after = max(self.retry_after_s, math.ceil(waiting / capacity) * self.retry_after_s)
        return ApiError(
            429,
            f"the server is overloaded ({waiting} requests queued); retry after {retry_after} s",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after)},
        )

    async def job_meta(self, job_id: str, owner: str | None) -> JobMeta | None:
        """The job's stored meta; None when unknown, expired, or created with another API key (to that key's
        caller a job of another key does not exist). ``owner`` None: any key's (a job token was checked)."""
        raw = await self._redis.get(keys.job_meta_key(job_id))
        meta = None if raw is None else JobMeta.from_json(raw)
        return meta if meta is not None and owner in (None, meta.owner) else None

    async def abort(self, job_id: str) -> None:
        """Ask the worker running (or about to run) this job to cancel it; it aborts the engine request."""
        await self._redis.zadd(keys.ARQ_ABORT_SET, {job_id: int(time.time() * 1000)})
