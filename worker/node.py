"""What every worker node does besides generating: heartbeats that renew its jobs' leases, the arq worker
that takes jobs only while there is room, a graceful drain on SIGTERM, and riding through a Redis outage.

Redis outage: arq's loop and the heartbeats wait for Redis to answer again (running jobs go on generating,
their events wait in ``write_events``), then carry on where they were. The one limit is the jobs' lease: once
no heartbeat has renewed it for ``job_lease_s``, another worker may take the jobs as soon as Redis is back,
so a worker still holding jobs then exits at once (``EXIT_REDIS_LOST``), writing nothing more for them."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from typing import Any

from arq.connections import ArqRedis
from arq.worker import Worker, func
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine.core_messages import CoreStats
from wire import keys
from wire.messages import WorkerHeartbeat, dumps, loads
from wire.publisher import EventBatch
from worker.intake import BatchClaimWorker
from worker.metrics import WorkerMetrics
from worker.settings import WorkerSettings
from worker.stats_log import StatsLog, interval_from_env

logger = logging.getLogger(__name__)

EXIT_REDIS_LOST = 4
# what an unreachable or restarting Redis raises (a LOADING reply is a ConnectionError too)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


class WorkerNode(abc.ABC):
    """Liveness and job intake of one worker; subclasses give ``generate`` (the job), ``pump`` and stats."""

    metrics: WorkerMetrics

    def __init__(
        self, settings: WorkerSettings, redis: ArqRedis, model_name: str, max_jobs: int, max_model_len: int
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.model_name = model_name
        self.max_jobs = max_jobs
        self.max_model_len = max_model_len
        self.active: set[str] = set()
        self.jobs_done = 0
        self.draining = False
        self._arq: Worker | None = None
        self.lease_renewed_at = time.monotonic()  # the last heartbeat that reached Redis
        self.stats_log = StatsLog(settings.worker_id, interval_from_env()) if settings.log_stats else None

    @abc.abstractmethod
    async def generate(self, ctx: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        """The arq job function."""

    @abc.abstractmethod
    async def pump(self) -> None:
        """Runs for the worker's life beside arq (the engine's outputs to Redis)."""

    @abc.abstractmethod
    def core_stats(self) -> CoreStats:
        """The engine's latest stats, for the heartbeat."""

    # -- heartbeat ----------------------------------------------------------------------------------------
    def heartbeat(self) -> WorkerHeartbeat:
        s = self.core_stats()
        return WorkerHeartbeat(
            self.settings.worker_id,
            self.model_name,
            self.max_jobs,
            self.max_model_len,
            active_jobs=len(self.active),
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_swap_preemptions=s.num_swap_preemptions,
            num_recompute_preemptions=s.num_recompute_preemptions,
            num_blocks_swapped_out=s.num_blocks_swapped_out,
            num_blocks_swapped_in=s.num_blocks_swapped_in,
            cpu_kv_cache_usage=s.cpu_kv_cache_usage,
            num_swapped=s.num_swapped,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            jobs_done=self.jobs_done,
            draining=self.draining,
            time=time.time(),
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    async def beat(self) -> None:
        hb = self.heartbeat()
        self.metrics.update(hb)
        if self.stats_log is not None:
            self.stats_log.observe(hb)
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.worker_key(hb.worker_id), hb.to_json(), px=ttl_ms)
            pipe.zadd(keys.WORKERS, {hb.worker_id: hb.time})
            pipe.zremrangebyscore(keys.WORKERS, "-inf", hb.time - 3600)  # forget long-dead workers
            lease_ms = int(self.settings.job_lease_s * 1000)
            for job_id in list(self._arq.tasks if self._arq is not None else ()):  # renew our jobs' leases
                pipe.pexpire(keys.ARQ_IN_PROGRESS_PREFIX + job_id, lease_ms)
            await pipe.execute()

    async def heartbeat_loop(self) -> None:
        failing = False
        while True:
            try:
                await self.beat()
                self.lease_renewed_at = time.monotonic()
                if failing:
                    logger.warning("heartbeat: Redis is back")
                failing = False
            except REDIS_DOWN as exc:
                if not failing:
                    logger.warning(
                        "heartbeat failed (%s): retrying every %.1f s", exc, self.settings.heartbeat_interval_s
                    )
                failing = True
                self.fence()
            except Exception as exc:  # noqa: BLE001 - keep beating through Redis hiccups
                logger.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def fence(self) -> None:
        """Exit if running jobs have been out of lease too long: they may already be another worker's."""
        lost_s = time.monotonic() - self.lease_renewed_at
        if not self.active or lost_s < self.settings.job_lease_s:
            return
        logger.error(
            "no heartbeat reached Redis for %.1f s (the jobs' lease is %.1f s): exiting so that the %d running "
            "jobs run again elsewhere",
            lost_s,
            self.settings.job_lease_s,
            len(self.active),
        )
        logging.shutdown()
        os._exit(EXIT_REDIS_LOST)

    async def wait_for_redis(self, max_delay_s: float = 1.0) -> None:
        """Until Redis answers a PING (backing off up to ``max_delay_s`` between tries)."""
        delay = 0.05
        while True:
            try:
                await self.redis.ping()
                return
            except REDIS_DOWN:
                self.fence()
                await asyncio.sleep(delay)
                delay = min(max_delay_s, 2 * delay)

    async def write_events(self, batch: EventBatch) -> None:
        """Write one batch of job events, waiting through a Redis outage (nothing is dropped or reordered:
        the pump takes no new core outputs meanwhile, they queue in the core's socket)."""
        while True:
            try:
                await batch.execute(self.redis)
                return
            except REDIS_DOWN as exc:
                logger.warning("writing %d events failed (%s): retrying when Redis answers", len(batch), exc)
                await self.wait_for_redis()

    async def forget(self) -> None:
        with contextlib.suppress(Exception):
            await self.redis.delete(keys.worker_key(self.settings.worker_id))
            await self.redis.zrem(keys.WORKERS, self.settings.worker_id)

    # -- running ----------------------------------------------------------------------------------------
    def arq_worker(self) -> BatchClaimWorker:
        # arq's own retry limit stays above ours so that the last attempt can still tell the client
        tries = self.settings.max_attempts + 1
        job = func(self.generate, name=keys.JOB_FUNCTION, max_tries=tries, timeout=self.settings.job_timeout_s)
        worker = BatchClaimWorker(
            functions=[job],
            queue_name=keys.QUEUE,
            redis_pool=self.redis,
            max_jobs=self.max_jobs,
            poll_delay=self.settings.poll_delay_s,
            allow_abort_jobs=True,
            handle_signals=False,
            job_serializer=dumps,
            job_deserializer=loads,
            keep_result=60,
            max_tries=tries,
            log_results=False,
        )
        # arq marks a running job in progress for its whole timeout, so a dead worker's jobs would wait an
        # hour; a short lease renewed by every heartbeat hands them to another worker within seconds
        worker.in_progress_timeout_s = self.settings.job_lease_s
        worker.idle_poll_s = self.settings.poll_delay_s
        worker.poll_delay_s = 0.0  # the wait is in BatchClaimWorker._poll_iteration (a wake-up ends it early)
        return worker

    async def wake_on_enqueue(self, worker: BatchClaimWorker) -> None:
        """Poll the queue as soon as the API announces a job (polling still catches anything missed)."""
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(keys.JOBS_CHANNEL)
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        worker.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the poll goes on meanwhile
                logger.warning("job wake-up subscription lost (%s); retrying", exc)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def drain(self, worker: Worker, main: asyncio.Task[None]) -> None:
        """Stop taking jobs, let the running ones finish (up to drain_timeout_s), then stop the worker."""
        self.draining = True
        worker.allow_pick_jobs = False
        with contextlib.suppress(Exception):
            await self.beat()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        main.cancel()

    async def run_arq(self, worker: Worker) -> None:
        """arq's loop, started again after a Redis outage (the jobs it runs are tasks of their own: they go on)."""
        while True:
            try:
                await worker.async_run()
                return
            except REDIS_DOWN as exc:
                logger.warning("lost Redis (%s): taking jobs again once it answers", exc)
                await self.wait_for_redis()
                logger.warning("Redis answers again: taking jobs")

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT (graceful) or a second signal (at once)."""
        worker = self._arq = self.arq_worker()
        main = asyncio.ensure_future(self.run_arq(worker))
        beats = asyncio.ensure_future(self.heartbeat_loop())
        wakes = asyncio.ensure_future(self.wake_on_enqueue(worker))
        pump = asyncio.ensure_future(self.pump())
        pump.add_done_callback(lambda t: t.cancelled() or main.cancel())  # a dead pump is a dead worker
        loop = asyncio.get_running_loop()
        drain_tasks: list[asyncio.Task[None]] = []

        def on_signal(sig: signal.Signals) -> None:
            if self.draining:
                logger.warning("%s again: stopping now", sig.name)
                main.cancel()
                return
            logger.info("%s: draining %d running jobs, taking no new ones", sig.name, len(self.active))
            drain_tasks.append(asyncio.ensure_future(self.drain(worker, main)))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        logger.info("worker %s: up to %d jobs from %s", self.settings.worker_id, self.max_jobs, keys.QUEUE)
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await main
        finally:
            beats.cancel()
            wakes.cancel()
            for task in list(worker.tasks.values()):
                task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
            pump.cancel()
            await self.forget()
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            raise RuntimeError("the event pump failed") from pump.exception()
