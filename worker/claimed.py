"""A claimed job's run, without arq's per-job round trips: what ``arq.worker.Worker.run_job`` reads before it
starts a job comes with the claim (``worker.intake``'s script), and what it writes after is batched.

arq starts every job with a MULTI/EXEC of its own (GET of the job, INCR and EXPIRE of its try count, ZREM of an
abort mark) and ends it with another (result, deletes, queue removal). In a burst of 256 jobs on this VM those two
were 16 % and 18 % of the worker front's busy samples, against 10 % for the job function itself (py-spy, 256 jobs
queued at once, tiny model): the front starts a burst's jobs one after another, so this is time the last job of a
burst waits before the engine sees it. Here the claim script does the reads for every job of a poll at once, and
the jobs that end in the same loop turn (a wave's last step ends them all) share one MULTI/EXEC.

The outcomes are arq 0.28's: a job gone before it starts, an abort before the start, an unknown function or too
many tries end it with a failed result; a job aborted while it runs ends with a cancelled result; a job cancelled
by the worker's own shutdown is left queued, its in-progress mark removed, for another worker to run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix
from arq.jobs import SerializationError, deserialize_job_raw, serialize_result
from arq.utils import ms_to_datetime, timestamp_ms
from arq.worker import JobExecutionFailed, Worker
from redis.asyncio import Redis

logger = logging.getLogger(__name__)

RETRY_KEY_TTL_S = 88400  # as arq's run_job


@dataclass(frozen=True)
class ClaimedJob:
    """What the claim script read for one job: its arq record (b"" when gone), the try this run is, whether an
    abort mark was waiting (and was removed)."""

    job_id: str
    score: int
    raw: bytes
    job_try: int
    aborted_before_start: bool


@dataclass(frozen=True)
class _Finish:
    job_id: str
    finish: bool  # False: leave the job queued for another run (only the in-progress mark goes)
    result: bytes | None


class FinishBatch:
    """The end-of-job writes of every job that ends in one event-loop turn, in one MULTI/EXEC."""

    def __init__(self, redis: Redis, queue_name: str, keep_result_ms: int) -> None:
        self._redis = redis
        self._queue = queue_name
        self._keep_result_ms = keep_result_ms
        self._pending: list[tuple[_Finish, asyncio.Future[None]]] = []
        self._flushes: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references to tasks

    async def finish(self, job_id: str, finish: bool, result: bytes | None) -> None:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((_Finish(job_id, finish, result), future))
        if len(self._pending) == 1:  # the flush runs from the next loop turn on: this turn's finishes join it
            task = asyncio.ensure_future(self._flush())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
        await future

    async def _flush(self) -> None:
        batch, self._pending = self._pending, []
        try:
            async with self._redis.pipeline(transaction=True) as tr:
                for f, _ in batch:
                    self._add(tr, f)
                await tr.execute()
        except BaseException as exc:  # noqa: BLE001 - each job's run sees its own failure (Redis lost: arq's)
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for _, future in batch:
            if not future.done():
                future.set_result(None)

    def _add(self, tr: Any, f: _Finish) -> None:
        if not f.finish:
            tr.delete(in_progress_key_prefix + f.job_id)
            return
        if f.result is not None and self._keep_result_ms > 0:
            tr.set(result_key_prefix + f.job_id, f.result, px=self._keep_result_ms)
        tr.delete(in_progress_key_prefix + f.job_id, retry_key_prefix + f.job_id, job_key_prefix + f.job_id)
        tr.zrem(abort_jobs_ss, f.job_id)
        tr.zrem(self._queue, f.job_id)


async def run_claimed(worker: Worker, finishes: FinishBatch, job: ClaimedJob) -> None:
    """One claimed job through its function (``worker.functions``), with arq's bookkeeping and outcomes."""
    start_ms = timestamp_ms()
    fields: tuple[str, tuple[Any, ...], dict[str, Any], int | None, int] = ("<unknown>", (), {}, None, 0)
    failure: BaseException | None = None
    if not job.raw:
        failure = JobExecutionFailed("job expired")
    else:
        try:
            fields = deserialize_job_raw(job.raw, deserializer=worker.job_deserializer)
        except SerializationError as exc:
            logger.exception("deserializing job %s failed", job.job_id)
            failure = exc
    name, args, kwargs, enqueue_try, enqueue_ms = fields
    job_try = max(job.job_try, enqueue_try or 0)
    function = worker.functions.get(name)
    failure = failure or _refusal(worker, job, function, name, job_try)
    if failure is not None or function is None:
        logger.warning("job %s not run: %r", job.job_id, failure)
        worker.jobs_failed += 1
        result = _result(worker, job, fields, job_try, False, failure, start_ms)
        await asyncio.shield(finishes.finish(job.job_id, True, result))
        return
    if job_try > job.job_try:  # the enqueuer asked for a later try than the count says (arq's _job_try)
        await worker.pool.setex(retry_key_prefix + job.job_id, RETRY_KEY_TTL_S, str(job_try))
    ctx = {**worker.ctx, "job_id": job.job_id, "job_try": job_try, "score": job.score}
    ctx["enqueue_time"] = ms_to_datetime(enqueue_ms)
    timeout_s = worker.job_timeout_s if function.timeout_s is None else function.timeout_s
    start_ms = timestamp_ms()
    task = worker.job_tasks[job.job_id] = asyncio.ensure_future(function.coroutine(ctx, *args, **kwargs))
    finish, success, outcome = True, False, None
    try:
        outcome = await asyncio.wait_for(task, timeout_s)
        success = True
        worker.jobs_complete += 1
    except asyncio.CancelledError as exc:
        if job.job_id in worker.aborting_tasks:  # aborted while it ran (the API's abort mark)
            worker.aborting_tasks.discard(job.job_id)
            worker.jobs_failed += 1
            outcome = exc
        else:  # this worker is stopping: the job stays queued for another one
            finish = False
            worker.jobs_retried += 1
    except Exception as exc:  # noqa: BLE001 - arq's: the failure is the job's result
        logger.exception("job %s failed", job.job_id)
        worker.jobs_failed += 1
        outcome = exc
    finally:
        worker.job_tasks.pop(job.job_id, None)
    result = _result(worker, job, fields, job_try, success, outcome, start_ms) if finish else None
    await asyncio.shield(finishes.finish(job.job_id, finish, result))


def _refusal(worker: Worker, job: ClaimedJob, function: Any, name: str, job_try: int) -> BaseException | None:
    """Why a readable job is not run (arq's order: an abort before the start, no such function, too many tries)."""
    if job.aborted_before_start:
        return asyncio.CancelledError()
    if function is None:
        return JobExecutionFailed(f"function {name!r} not found")
    max_tries = worker.max_tries if function.max_tries is None else function.max_tries
    return JobExecutionFailed(f"max {max_tries} retries exceeded") if job_try > max_tries else None


def _result(
    worker: Worker, job: ClaimedJob, fields: tuple[Any, ...], job_try: int, success: bool, value: Any, start_ms: int
) -> bytes | None:
    name, args, kwargs, _, enqueue_ms = fields
    return serialize_result(
        name,
        args,
        kwargs,
        job_try,
        enqueue_ms,
        success,
        value,
        start_ms,
        timestamp_ms(),
        f"{job.job_id}:{name}",
        worker.queue_name,
        job_id=job.job_id,
        serializer=worker.job_serializer,
    )
