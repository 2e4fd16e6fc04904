"""Claimed jobs run without arq's per-job round trips (``worker.claimed``), with arq 0.28's outcomes, checked
through arq's own client against a real Redis: results, try counts, aborts before and during a run, too many
tries, a job gone before its start, a stopping worker leaving its job queued; and jobs that end together
share one MULTI/EXEC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, retry_key_prefix
from arq.jobs import Job, JobStatus
from arq.worker import func

from worker.intake import BatchClaimWorker

QUEUE = "test:claimed"


@pytest.fixture
async def pool(redis_url: str) -> AsyncIterator[ArqRedis]:
    redis = await create_pool(RedisSettings.from_dsn(redis_url), default_queue_name=QUEUE)
    yield redis
    await redis.aclose()


def _worker(pool: ArqRedis, job: Any, **kwargs: Any) -> BatchClaimWorker:
    worker = BatchClaimWorker(
        functions=[func(job, name="job", max_tries=kwargs.pop("max_tries", 3))],
        redis_pool=pool,
        queue_name=QUEUE,
        allow_abort_jobs=True,
        keep_result=60,
        **kwargs,
    )
    worker.main_task = None
    return worker


async def _settle(worker: BatchClaimWorker) -> None:
    await asyncio.gather(*worker.tasks.values(), return_exceptions=True)


async def test_results_and_try_counts_as_arq_writes_them(pool: ArqRedis) -> None:
    seen: list[tuple[str, int]] = []

    async def job(ctx: dict[str, Any], x: int) -> int:
        seen.append((ctx["job_id"], ctx["job_try"]))
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    for i, x in enumerate([1, 2, -1]):
        await pool.enqueue_job("job", x, _job_id=f"r{i}")
    await pool.set(retry_key_prefix + "r1", b"1")  # r1 ran once before, on a worker that was lost
    worker = _worker(pool, job)
    await worker._poll_iteration()
    await _settle(worker)
    assert sorted(seen) == [("r0", 1), ("r1", 2), ("r2", 1)]
    assert await Job("r0", pool, _queue_name=QUEUE).result(timeout=5) == 2
    assert await Job("r1", pool, _queue_name=QUEUE).result(timeout=5) == 4
    with pytest.raises(ValueError, match="negative"):
        await Job("r2", pool, _queue_name=QUEUE).result(timeout=5)
    assert await pool.zcard(QUEUE) == 0  # finished jobs leave the queue, their records and marks go
    for i in range(3):
        assert not await pool.exists(
            job_key_prefix + f"r{i}", retry_key_prefix + f"r{i}", in_progress_key_prefix + f"r{i}"
        )
    assert worker.jobs_complete == 2 and worker.jobs_failed == 1


async def test_jobs_not_run_end_with_a_failed_result(pool: ArqRedis) -> None:
    ran: list[str] = []

    async def job(ctx: dict[str, Any]) -> None:
        ran.append(ctx["job_id"])

    for name in ("aborted", "tried", "gone"):
        await pool.enqueue_job("job", _job_id=name)
    await pool.zadd(abort_jobs_ss, {"aborted": 1})  # aborted before any worker started it
    await pool.set(retry_key_prefix + "tried", b"3")  # three runs already: this is the fourth of max 3
    await pool.delete(job_key_prefix + "gone")  # its record expired while it waited
    worker = _worker(pool, job)
    await worker._poll_iteration()
    await _settle(worker)
    assert ran == []
    with pytest.raises(asyncio.CancelledError):
        await Job("aborted", pool, _queue_name=QUEUE).result(timeout=5)
    with pytest.raises(Exception, match="max 3 retries exceeded"):
        await Job("tried", pool, _queue_name=QUEUE).result(timeout=5)
    assert await pool.zcard(QUEUE) == 0 and await pool.zcard(abort_jobs_ss) == 0
    assert worker.jobs_failed == 3


async def test_abort_while_running_and_a_stopping_worker(pool: ArqRedis) -> None:
    started = asyncio.Event()

    async def job(ctx: dict[str, Any]) -> None:
        started.set()
        await asyncio.sleep(60)

    await pool.enqueue_job("job", _job_id="abort-me")
    worker = _worker(pool, job)
    await worker._poll_iteration()
    await asyncio.wait_for(started.wait(), 5)
    await pool.zadd(abort_jobs_ss, {"abort-me": 1})
    await worker._poll_iteration()  # arq's own abort check cancels the running job
    await _settle(worker)
    assert await Job("abort-me", pool, _queue_name=QUEUE).status() == JobStatus.complete
    with pytest.raises(asyncio.CancelledError):
        await Job("abort-me", pool, _queue_name=QUEUE).result(timeout=5)

    started.clear()
    await pool.enqueue_job("job", _job_id="left")
    await worker._poll_iteration()
    await asyncio.wait_for(started.wait(), 5)
    for task in worker.tasks.values():  # the worker stops (as WorkerNode.serve does): the job is left queued
        task.cancel()
    await _settle(worker)
    assert await pool.zscore(QUEUE, "left") is not None and await pool.exists(job_key_prefix + "left")
    assert not await pool.exists(in_progress_key_prefix + "left")  # another worker may take it at once
    assert await pool.get(retry_key_prefix + "left") == b"1"  # and runs it as try 2


async def test_jobs_that_end_together_share_one_transaction(pool: ArqRedis) -> None:
    go = asyncio.Event()

    async def job(ctx: dict[str, Any]) -> str:
        await go.wait()
        return str(ctx["job_id"])

    for i in range(20):
        await pool.enqueue_job("job", _job_id=f"t{i}")
    worker = _worker(pool, job, max_jobs=20)
    await worker._poll_iteration()
    await asyncio.sleep(0.1)
    before = (await pool.info("commandstats")).get("cmdstat_exec", {}).get("calls", 0)
    go.set()
    await _settle(worker)
    after = (await pool.info("commandstats"))["cmdstat_exec"]["calls"]
    assert after - before == 1
    assert [await Job(f"t{i}", pool, _queue_name=QUEUE).result(timeout=5) for i in range(20)] == [
        f"t{i}" for i in range(20)
    ]
