"""The worker front: the arq side of a worker node. It takes jobs while the engine has room, hands them to
its engine core process, turns the core's per-step token deltas into job events (incremental text, stop
strings, n > 1, logprobs) and writes all of one step's events in one Redis pipeline.

The engine core (``engine.core``) runs in its own process, so this process's event loop and the engine's
busy loop never share an interpreter lock. A job takes a place only while fewer than ``max_jobs`` (= the
engine's ``max_num_seqs``) run, so the queue builds in Redis, not in device memory, and any number of
workers can drain one queue. SIGTERM: stop taking jobs, finish the running ones, exit (a second signal
stops at once). If the core dies, the front exits at once with ``EXIT_CORE_DIED``: its jobs' leases lapse
and they run again elsewhere, as for any lost worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from arq.connections import ArqRedis
from opentelemetry import trace
from opentelemetry.propagate import extract
from prometheus_client import REGISTRY, CollectorRegistry

from deploy.gc_heap import collect_young_if_due
from engine.core_messages import CoreReady, CoreStats, RequestError, StepOutputs
from engine.output_processor import OutputProcessor
from engine.request import validate_request
from engine.sampling_params import SamplingParams
from wire.messages import ErrorEvent, FinalEvent, JobPayload
from wire.publisher import EventBatch, JobEventWriter
from worker.core_client import CoreClient
from worker.failover import DivergedError, PriorAttempt
from worker.jobs import ActiveJob
from worker.metrics import WorkerMetrics
from worker.node import WorkerNode
from worker.pump_trace import PumpTrace
from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("pagedserve.worker")

EXIT_CORE_DIED = 3

_LOST_MID_STREAM = (
    "the worker running this request was lost mid-stream and a sampled (unseeded) request cannot be continued; "
    "retry the request"
)


def sampling_params(payload: JobPayload) -> SamplingParams:
    """The engine's params from the job's (checked once by the wire's ``SamplingSpec``, again by the engine)."""
    return SamplingParams.from_dict(payload.params.to_dict())


def _is_deterministic(payload: JobPayload) -> bool:
    try:
        return sampling_params(payload).is_deterministic
    except ValueError:
        return True  # refused as invalid in _run


class GenerationWorker(WorkerNode):
    """The job function and the pump from core outputs to Redis (heartbeats and running: ``WorkerNode``)."""

    def __init__(
        self,
        core: CoreClient,
        settings: WorkerSettings,
        redis: ArqRedis,
        model_name: str,
        tokenizer: Any,
        registry: CollectorRegistry = REGISTRY,  # the metrics' (another one: several workers in one process)
    ):
        assert core.ready is not None, "CoreClient.start() first"
        self.ready: CoreReady = core.ready
        super().__init__(
            settings, redis, model_name, settings.max_jobs or self.ready.capacity, self.ready.max_model_len
        )
        self.core = core
        self.processor = OutputProcessor(tokenizer)
        self.jobs: dict[str, ActiveJob] = {}
        self.metrics = WorkerMetrics(model_name, settings.worker_id, registry)
        self.stats = CoreStats()
        # spans only with a tracer provider installed (api.tracing.setup_tracing): without one the no-op spans
        # and the trace-context parsing were ~18 us of the ~0.2 ms a job start costs the front on this VM
        self.tracing = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        self.pump_trace = PumpTrace.from_env(core.client)  # benchmarks only (bench stack): the pump's timing

    def core_stats(self) -> CoreStats:
        return self.stats

    # -- the job ----------------------------------------------------------------------------------------
    async def generate(self, ctx: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        """arq job function: one request through the engine; its events are written by the pump."""
        payload = JobPayload.from_dict(data)
        started = time.time()
        self.metrics.queue_time.observe(max(0.0, started - payload.enqueue_time))
        job_try = int(ctx.get("job_try", 1))
        prior = await PriorAttempt.load(self.redis, payload.request_id) if job_try > 1 else PriorAttempt()
        writer = JobEventWriter(
            self.redis,
            payload.request_id,
            payload.events_ttl_s,
            payload.stream,
            prior.num_events,
            payload.reply_channel,
        )
        outcome = await self._refuse(payload, writer, started, job_try, prior)
        if outcome is None:
            with self._job_span(payload, started, job_try):
                self.active.add(payload.request_id)
                try:
                    outcome = await self._run(payload, writer, started, prior)
                finally:
                    self.active.discard(payload.request_id)
                    self.jobs_done += 1
        self.metrics.jobs.labels(outcome).inc()
        return {"outcome": outcome}

    @contextlib.contextmanager
    def _job_span(self, payload: JobPayload, started: float, job_try: int) -> Iterator[None]:
        """The job's span in the API request's trace (one trace for both tiers), with its queue wait as a child."""
        if not self.tracing:
            yield
            return
        with tracer.start_as_current_span(
            "worker.job",
            context=extract(payload.trace_context),
            kind=trace.SpanKind.CONSUMER,
            attributes={"pagedserve.request_id": payload.request_id, "pagedserve.job_try": job_try},
        ):
            queue_span = tracer.start_span("queue_wait", start_time=int(payload.enqueue_time * 1e9))
            queue_span.end(end_time=int(started * 1e9))
            yield

    async def _refuse(
        self, payload: JobPayload, writer: JobEventWriter, now: float, job_try: int, prior: PriorAttempt
    ) -> str | None:
        """A reason not to generate this job at all (and its error event), or None."""
        if prior.finished:  # the last attempt wrote its final event; arq lost only the bookkeeping
            return "duplicate"
        if job_try > self.settings.max_attempts:
            message = f"the request was attempted on {job_try - 1} workers and each was lost; not trying again"
            await writer.error(message, "server_error", "worker_lost", 503)
            return "worker_lost"
        if prior.sent_anything and not _is_deterministic(payload):
            await writer.error(_LOST_MID_STREAM, "server_error", "worker_lost", 503)
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
        rid = payload.request_id
        try:
            params = sampling_params(payload)
            validate_request(payload.prompt_token_ids, params, self.ready.vocab_size, self.ready.max_model_len)
            self.processor.add(rid, payload.prompt_token_ids, params)
        except ValueError as exc:  # the engine would refuse it: say so before anything runs
            await writer.error(str(exc), "invalid_request_error", "invalid_request", 400)
            return "invalid"
        job = ActiveJob(payload, params, writer.next_seq, prior, started, asyncio.get_running_loop().create_future())
        self.jobs[rid] = job
        self.core.add(rid, payload.prompt_token_ids, params.to_dict(), payload.priority)
        try:
            return await job.done
        except asyncio.CancelledError:  # the client left (arq abort) or a hard shutdown
            if self.jobs.pop(rid, None) is not None:  # not ended by the pump meanwhile
                self.processor.drop(rid)
                self.core.abort(rid)
                aborted = ErrorEvent(job.take_seq(), "request aborted", "server_error", "aborted", 499)
                batch = EventBatch()
                batch.add(rid, aborted, payload.events_ttl_s, job.channel)
                with contextlib.suppress(Exception):
                    await asyncio.shield(batch.execute(self.redis))
            raise

    # -- the pump: core outputs -> events -> one pipeline per batch of steps ------------------------------
    async def pump(self) -> None:
        """Forever: every step message that has arrived, applied to its jobs, its events sent in one pipeline.
        One pipeline is in flight at a time and the next step's events are built while it is, so its round trip
        overlaps the front's own work; steps that arrive meanwhile queue in the socket and are merged. Once a
        pipeline has gone out and no step is waiting, a due young collection runs (``collect_young_if_due``)."""
        writing: asyncio.Task[None] | None = None
        while True:
            messages = await self.core.outputs()
            received = time.perf_counter()
            batch, ended = self._events(messages)
            built = time.perf_counter()
            if writing is not None:
                await writing  # in order: a job's events never overtake its earlier ones
            writing = asyncio.ensure_future(self._write(batch, ended, messages, received, built))
            await asyncio.sleep(0)  # the pipeline goes out (its task runs to its reply) before anything else
            if not self.core.has_outputs():
                collect_young_if_due()

    def _events(self, messages: list[StepOutputs]) -> tuple[EventBatch, list[tuple[ActiveJob, str]]]:
        """The events of these step messages, and the jobs they end (with their outcomes)."""
        batch = EventBatch()
        ended: list[tuple[ActiveJob, str]] = []
        touched: dict[str, ActiveJob] = {}
        for message in messages:
            self._apply(message, batch, ended, touched)
        now = time.time()
        for job in touched.values():
            self._flush(job, batch, ended, now)
        return batch, ended

    async def _write(
        self,
        batch: EventBatch,
        ended: list[tuple[ActiveJob, str]],
        messages: list[StepOutputs],
        received: float,
        built: float,
    ) -> None:
        """Write one batch (waiting through a Redis outage), then end its jobs: a job is done once its final
        event is in Redis."""
        num_events = len(batch)
        sent = time.perf_counter()
        try:
            await self.write_events(batch)
        except Exception as exc:  # noqa: BLE001 - the jobs' coroutines report it to arq
            logger.exception("writing %d events failed", num_events)
            for job, _ in ended:
                if not job.done.done():
                    job.done.set_exception(exc)
            return
        if self.pump_trace is not None:
            oldest = min((m.sent_at for m in messages), default=received)
            self.pump_trace.record(received, len(messages), oldest, num_events, built, sent)
        for job, outcome in ended:
            if not job.done.done():
                job.done.set_result(outcome)

    def _apply(
        self, message: StepOutputs, batch: EventBatch, ended: list[tuple[ActiveJob, str]], touched: dict[str, ActiveJob]
    ) -> None:
        self.stats = message.stats
        for error in message.errors:
            self._fail(error, batch, ended)
        step = self.processor.process(message.outputs)
        for request_id, index in step.aborts:  # a stop string ended it: the core need not go on
            self.core.abort(request_id, [index])
        for update in step.updates:
            job = self.jobs.get(update.request_id)
            if job is None:
                continue
            try:
                job.take(update)
            except DivergedError as exc:  # a rerun after a lost worker came out different: never splice
                self._end(job, batch, ended, "worker_lost")
                message_text = f"the worker running this request was lost and the rerun differs ({exc}); retry"
                batch.add(job.payload.request_id, self._error(job, message_text, "worker_lost", 503), *self._to(job))
                continue
            touched[update.request_id] = job
        for request_id in step.finished:
            job = self.jobs.get(request_id)
            if job is not None:
                job.finished = True

    def _flush(self, job: ActiveJob, batch: EventBatch, ended: list[tuple[ActiveJob, str]], now: float) -> None:
        rid = job.payload.request_id
        if self.jobs.get(rid) is not job:
            return  # ended by an error in this batch
        if job.first_token_at is None and any(c.num_tokens for c in job.choices.values()):
            job.first_token_at = now
            self.metrics.ttft.observe(now - job.payload.enqueue_time)
        if job.payload.stream and job.should_flush(self.settings.stream_interval):
            event = job.delta()
            if event is not None:  # (time between deltas is the API's metric: a histogram per event here cost 17 %)
                job.last_event_at = now
                batch.add(rid, event, *self._to(job))
        if job.finished:
            out = self.processor.pop(rid)
            final = FinalEvent(job.take_seq(), job.result(out, now), streamed=job.payload.stream)
            batch.add(rid, final, *self._to(job))
            self.metrics.e2e.observe(now - job.payload.enqueue_time)
            aborted = any(o.finish_reason == "abort" for o in out.outputs)
            self._end(job, batch, ended, "abort" if aborted else "ok")

    def _fail(self, error: RequestError, batch: EventBatch, ended: list[tuple[ActiveJob, str]]) -> None:
        job = self.jobs.get(error.request_id)
        if job is None:
            return
        if error.kind == "invalid":
            event = self._error(job, error.message, "invalid_request", 400, "invalid_request_error")
            outcome = "invalid"
        else:
            event = self._error(job, f"generation failed: {error.message}", "engine_error", 500)
            outcome = "failed"
        batch.add(error.request_id, event, *self._to(job))
        self._end(job, batch, ended, outcome)

    def _end(self, job: ActiveJob, batch: EventBatch, ended: list[tuple[ActiveJob, str]], outcome: str) -> None:
        rid = job.payload.request_id
        self.jobs.pop(rid, None)
        if rid in self.processor:
            self.processor.drop(rid)
            self.core.abort(rid)
        ended.append((job, outcome))

    @staticmethod
    def _error(job: ActiveJob, message: str, code: str, status: int, type_: str = "server_error") -> ErrorEvent:
        return ErrorEvent(job.take_seq(), message, type_, code, status)

    @staticmethod
    def _to(job: ActiveJob) -> tuple[int, str]:
        return job.payload.events_ttl_s, job.channel

    def on_core_death(self, exit_code: int | None) -> None:
        """No engine, no worker: exit now, without writing anything, so the jobs' leases lapse and each runs
        again elsewhere (or its client gets ``worker_lost``), exactly as when the whole worker is lost."""
        logger.error(
            "engine core exited (code %s) with %d jobs in flight: exiting so they run again elsewhere",
            exit_code,
            len(self.jobs),
        )
        logging.shutdown()
        os._exit(EXIT_CORE_DIED)
