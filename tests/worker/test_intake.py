"""BatchClaimWorker against a real Redis and arq's own queue: one poll claims up to its room, skipping jobs that
other workers run (they stay in the queue until done), exactly once across workers."""

from __future__ import annotations

import asyncio
from typing import Any

from arq.connections import RedisSettings, create_pool
from arq.constants import in_progress_key_prefix
from arq.worker import func

from worker.intake import BatchClaimWorker

QUEUE = "test:intake"


async def test_a_poll_skips_jobs_running_elsewhere_and_fills_its_room(redis_url: str) -> None:
    pool = await create_pool(RedisSettings.from_dsn(redis_url), default_queue_name=QUEUE)
    ran: list[str] = []
    release = asyncio.Event()

    async def job(ctx: dict[str, Any], name: str) -> None:
        ran.append(name)
        await release.wait()

    try:
        for i in range(10):
            await pool.enqueue_job("job", f"j{i}", _job_id=f"j{i}")
        for i in range(6):  # the queue's oldest six run on another worker
            await pool.set(in_progress_key_prefix + f"j{i}", b"1", px=60_000)
        workers = [
            BatchClaimWorker(functions=[func(job, name="job")], redis_pool=pool, queue_name=QUEUE, max_jobs=3)
            for _ in range(2)
        ]
        for w in workers:
            w.main_task = None
            await w._poll_iteration()
        await asyncio.sleep(0.1)
        assert sorted(ran) == ["j6", "j7", "j8", "j9"]  # each once: 3 for the first worker, the last for the other
        assert [w.job_counter for w in workers] == [3, 1]
    finally:
        release.set()
        for w in workers:
            await asyncio.gather(*w.tasks.values(), return_exceptions=True)
        await pool.aclose()


async def test_jobs_seen_running_elsewhere_are_not_checked_again_for_a_while(redis_url: str) -> None:
    pool = await create_pool(RedisSettings.from_dsn(redis_url), default_queue_name=QUEUE)
    ran: list[str] = []

    async def job(ctx: dict[str, Any], name: str) -> None:
        ran.append(name)

    try:
        for i in range(4):
            await pool.enqueue_job("job", f"k{i}", _job_id=f"k{i}")
            await pool.set(in_progress_key_prefix + f"k{i}", b"1", px=60_000)
        worker = BatchClaimWorker(functions=[func(job, name="job")], redis_pool=pool, queue_name=QUEUE, max_jobs=8)
        worker.main_task = None
        await worker._poll_iteration()
        assert ran == [] and sorted(worker._taken or {}) == ["k0", "k1", "k2", "k3"]
        await pool.delete(in_progress_key_prefix + "k0")  # its worker died and the lease lapsed
        await worker._poll_iteration()
        assert ran == []  # still skipped: seen running a moment ago
        worker.skip_taken_s = 0.0
        worker._taken = {}
        await worker._poll_iteration()
        await asyncio.sleep(0.1)
        assert ran == ["k0"]
    finally:
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await pool.aclose()
