"""The arq worker: pulls generation jobs from Redis into the engine's continuous batch and streams their
tokens back as seq-numbered events (``wire``).

A worker takes a job only while it runs fewer than ``max_jobs`` (= the engine's ``max_num_seqs``), so the
queue builds in Redis, not in device memory, and any number of workers can drain one queue. SIGTERM: stop
taking jobs, finish the running ones, exit (a second signal stops at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.worker import Worker, func
from opentelemetry import trace
from opentelemetry.propagate import extract
from prometheus_client import start_http_server

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.failover import DivergedError, PriorAttempt
from engine.request import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker_metrics import WorkerMetrics
from wire import keys
from wire.messages import (
    ChoiceDelta,
    ChoiceResult,
    JobPayload,
    JobResult,
    TokenLogprob,
    WorkerHeartbeat,
    dumps,
    loads,
)
from wire.publisher import JobEventWriter

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("pagedserve.worker")


@dataclass
class WorkerSettings:
    """How a worker talks to the queue. ``max_jobs`` None = the engine's capacity (max_num_seqs)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    max_jobs: int | None = None
    poll_delay_s: float = 0.02  # how often an idle worker looks at the queue (arq's default 0.5 s adds TTFT)
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 10.0
    drain_timeout_s: float = 600.0  # on SIGTERM, how long running jobs may take to finish
    job_timeout_s: float = 3600.0
    job_lease_s: float = 10.0  # a dead worker's jobs run again elsewhere this long after its last heartbeat
    max_attempts: int = 3  # a job that took down this many workers gets an error instead of a fourth
    metrics_port: int | None = None  # Prometheus endpoint of this worker; None = off

    def __post_init__(self) -> None:
        if self.max_jobs is not None and self.max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {self.max_jobs}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must exceed heartbeat_interval_s")
        if self.job_lease_s <= 2 * self.heartbeat_interval_s:
            raise ValueError("job_lease_s must be more than two heartbeat intervals (each beat renews the lease)")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


def _token_logprobs(out: CompletionOutput, start: int, k: int) -> list[TokenLogprob] | None:
    if out.logprobs is None:
        return None
    result = []
    for token_id, lps in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
        top = sorted(lps.items(), key=lambda kv: kv[1], reverse=True)[:k]
        result.append(TokenLogprob(token_id, lps.get(token_id, float("-inf")), top))
    return result


class GenerationWorker:
    """Runs jobs on one ``AsyncEngine``: the arq job function, heartbeats, metrics, graceful drain."""

    def __init__(self, engine: AsyncEngine, settings: WorkerSettings, redis: ArqRedis, model_name: str) -> None:
        self.engine = engine
        self.settings = settings
        self.redis = redis
        self.model_name = model_name
        self.max_jobs = settings.max_jobs or engine.capacity
        self.metrics = WorkerMetrics()
        self.active: set[str] = set()
        self.jobs_done = 0
        self.draining = False
        self._arq: Worker | None = None

    # -- the job ----------------------------------------------------------------------------------------
    async def generate(self, ctx: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        """arq job function: one request through the engine, events published as they come."""
        payload = JobPayload.from_dict(data)
        writer = JobEventWriter(self.redis, payload.request_id, payload.events_ttl_s, payload.stream)
        started = time.time()
        self.metrics.queue_time.observe(max(0.0, started - payload.enqueue_time))
        job_try = int(ctx.get("job_try", 1))
        prior = await PriorAttempt.load(self.redis, payload.request_id) if job_try > 1 else PriorAttempt()
        writer.next_seq = prior.num_events
        outcome = await self._refuse(payload, writer, started, job_try, prior)
        if outcome is not None:
            self.metrics.jobs.labels(outcome).inc()
            return {"outcome": outcome}
        parent = extract(payload.trace_context)
        with tracer.start_as_current_span("worker.job", context=parent):
            queue_span = tracer.start_span("queue_wait", start_time=int(payload.enqueue_time * 1e9))
            queue_span.end(end_time=int(started * 1e9))
            self.active.add(payload.request_id)
            try:
                outcome = await self._run(payload, writer, started, prior)
            finally:
                self.active.discard(payload.request_id)
                self.jobs_done += 1
        self.metrics.jobs.labels(outcome).inc()
        return {"outcome": outcome}

    async def _refuse(
        self, payload: JobPayload, writer: JobEventWriter, now: float, job_try: int, prior: PriorAttempt
    ) -> str | None:
        """A reason not to generate this job at all (and its error event), or None."""
        if prior.finished:  # the last attempt wrote its final event; arq lost only the bookkeeping
            return "duplicate"
        if job_try > self.settings.max_attempts:
            await writer.error(
                f"the request was attempted on {job_try - 1} workers and each was lost; not trying again",
                "server_error",
                "worker_lost",
                503,
            )
            return "worker_lost"
        if prior.sent_anything and not SamplingParams.from_dict(payload.params).is_deterministic:
            await writer.error(
                "the worker running this request was lost mid-stream and a sampled (unseeded) request cannot "
                "be continued; retry the request",
                "server_error",
                "worker_lost",
                503,
            )
            return "worker_lost"
        if now > payload.deadline and not prior.sent_anything:
            waited = now - payload.enqueue_time
            await writer.error(
                f"request dropped: it waited {waited:.1f} s in the queue, past its "
                f"{payload.deadline - payload.enqueue_time:.1f} s deadline; retry later",
                "timeout",
                "queue_deadline_exceeded",
                503,
            )
            return "deadline"
        return None

    async def _run(self, payload: JobPayload, writer: JobEventWriter, started: float, prior: PriorAttempt) -> str:
        try:
            params = SamplingParams.from_dict(payload.params)
            stream = self.engine.generate(payload.request_id, payload.prompt_token_ids, params, payload.priority)
            first_at: float | None = None
            last_at = started
            sent = prior.sent()  # choice index -> (chars, tokens) already published (by an earlier attempt)
            final: RequestOutput | None = None
            prefill = tracer.start_span("prefill")
            decode = None
            async for out in stream:
                now = time.time()
                if first_at is None:
                    first_at = now
                    prefill.end()
                    decode = tracer.start_span("decode")
                    self.metrics.ttft.observe(now - payload.enqueue_time)
                else:
                    self.metrics.itl.observe(now - last_at)
                last_at = now
                prior.check(out)
                deltas = self._deltas(out, sent, params.logprobs)
                if deltas:
                    await writer.delta(deltas)
                if out.finished:
                    final = out
            if decode is not None:
                decode.end()
            else:
                prefill.end()
        except DivergedError as exc:  # a rerun after a lost worker came out different: never splice streams
            self.engine.abort(payload.request_id)
            await writer.error(
                f"the worker running this request was lost and the rerun differs ({exc}); retry the request",
                "server_error",
                "worker_lost",
                503,
            )
            return "worker_lost"
        except ValueError as exc:  # the engine refused the input (before any output)
            await writer.error(str(exc), "invalid_request_error", "invalid_request", 400)
            return "invalid"
        except asyncio.CancelledError:  # the client left (arq abort) or a hard shutdown
            self.engine.abort(payload.request_id)  # closing the stream did too; abort is idempotent
            with contextlib.suppress(Exception):
                await asyncio.shield(writer.error("request aborted", "server_error", "aborted", 499))
            raise
        except Exception as exc:  # noqa: BLE001 - the caller must hear about it, not hang
            logger.exception("job %s failed", payload.request_id)
            await writer.error(f"generation failed: {exc}", "server_error", "engine_error", 500)
            return "failed"
        assert final is not None
        await writer.final(self._result(payload, final, started, first_at))
        self.metrics.e2e.observe(time.time() - payload.enqueue_time)
        return "abort" if any(c.finish_reason == "abort" for c in final.outputs) else "ok"

    @staticmethod
    def _deltas(out: RequestOutput, sent: dict[int, tuple[int, int]], k: int | None) -> list[ChoiceDelta]:
        deltas = []
        for o in out.outputs:
            chars, tokens = sent.get(o.index, (0, 0))
            if len(o.text) <= chars and len(o.token_ids) <= tokens:  # nothing new (or resent by a rerun)
                continue
            lps = _token_logprobs(o, tokens, k) if k is not None else None
            deltas.append(ChoiceDelta(o.index, o.text[chars:], list(o.token_ids[tokens:]), lps))
            sent[o.index] = (len(o.text), len(o.token_ids))
        return deltas

    def _result(self, payload: JobPayload, out: RequestOutput, started: float, first_at: float | None) -> JobResult:
        k = payload.params.get("logprobs")
        choices = [
            ChoiceResult(
                o.index,
                o.text,
                list(o.token_ids),
                o.finish_reason or "abort",
                _token_logprobs(o, 0, k) if k is not None else None,
                o.stop_reason,
            )
            for o in out.outputs
        ]
        now = time.time()
        return JobResult(
            payload.request_id,
            payload.model,
            choices,
            len(payload.prompt_token_ids),
            sum(len(c.token_ids) for c in choices),
            out.num_cached_tokens,
            queue_time_s=started - payload.enqueue_time,
            ttft_s=None if first_at is None else first_at - payload.enqueue_time,
            e2e_s=now - payload.enqueue_time,
        )

    # -- heartbeat ----------------------------------------------------------------------------------------
    def heartbeat(self) -> WorkerHeartbeat:
        s = self.engine.stats()
        return WorkerHeartbeat(
            self.settings.worker_id,
            self.model_name,
            self.max_jobs,
            self.engine.max_model_len,
            active_jobs=len(self.active),
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
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
        while True:
            try:
                await self.beat()
            except Exception as exc:  # noqa: BLE001 - keep beating through Redis hiccups
                logger.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def forget(self) -> None:
        with contextlib.suppress(Exception):
            await self.redis.delete(keys.worker_key(self.settings.worker_id))
            await self.redis.zrem(keys.WORKERS, self.settings.worker_id)

    # -- running ----------------------------------------------------------------------------------------
    def arq_worker(self) -> Worker:
        # arq's own retry limit stays above ours so that the last attempt can still tell the client
        tries = self.settings.max_attempts + 1
        job = func(self.generate, name=keys.JOB_FUNCTION, max_tries=tries, timeout=self.settings.job_timeout_s)
        worker = Worker(
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
        return worker

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

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT (graceful) or a second signal (at once)."""
        worker = self._arq = self.arq_worker()
        main = asyncio.ensure_future(worker.async_run())
        beats = asyncio.ensure_future(self.heartbeat_loop())
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
            for task in list(worker.tasks.values()):
                task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
            await self.forget()


async def run_worker(engine_config: EngineConfig, settings: WorkerSettings, model_name: str = "") -> None:
    """Load the engine, connect to Redis, serve jobs until signalled, shut down cleanly."""
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port)
    redis_settings = RedisSettings.from_dsn(settings.redis_url)
    redis = await create_pool(
        redis_settings, job_serializer=dumps, job_deserializer=loads, default_queue_name=keys.QUEUE
    )
    engine = await asyncio.to_thread(AsyncEngine, engine_config)
    try:
        await GenerationWorker(engine, settings, redis, model_name).serve()
    finally:
        await engine.shutdown()
        await redis.aclose()
