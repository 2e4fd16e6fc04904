"""Jobs nobody starts before their queue deadline: dropped with an error the caller receives, never run late;
jobs that did start (their worker may have died: the lease hands them on) are left alone."""

from __future__ import annotations

import time

import httpx
import redis

from api.app import connect_redis
from api.reaper import QueueReaper
from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, start_api
from wire import keys
from wire.messages import ErrorEvent, JobPayload, decode_event
from wire.sampling import SamplingSpec


async def _enqueue(pool, job_id: str, age_s: float) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    payload = JobPayload(job_id, MODEL, [1, 2], SamplingSpec(max_tokens=2), now - age_s, now - age_s + 1)
    await pool.enqueue_job(keys.JOB_FUNCTION, payload.to_dict(), _job_id=job_id, _queue_name=keys.QUEUE)
    await pool.zadd(keys.QUEUE, {job_id: int((now - age_s) * 1000)})  # as if enqueued age_s ago


async def test_sweep_drops_only_jobs_that_never_started(redis_url: str) -> None:
    pool = await connect_redis(redis_url)
    try:
        await _enqueue(pool, "old", age_s=10)
        await _enqueue(pool, "retried", age_s=10)
        await pool.set(keys.ARQ_RETRY_PREFIX + "retried", 1)  # it ran once; its worker's lease ran out
        await _enqueue(pool, "running", age_s=10)
        await pool.set(keys.ARQ_IN_PROGRESS_PREFIX + "running", 1)
        await _enqueue(pool, "young", age_s=0)
        reaper = QueueReaper(pool, deadline_s=5, events_ttl_s=60, grace_s=1)
        assert await reaper.sweep() == ["old"]
        assert await reaper.sweep() == []  # once
        queued = {m.decode() for m in await pool.zrange(keys.QUEUE, 0, -1)}
        assert queued == {"retried", "running", "young"}
        assert not await pool.exists(keys.ARQ_JOB_PREFIX + "old")
        (raw,) = await pool.lrange(keys.events_key("old"), 0, -1)  # type: ignore[misc]
        event = decode_event(raw)
        assert isinstance(event, ErrorEvent) and event.code == "queue_deadline_exceeded" and event.status == 503
    finally:
        await pool.aclose()


def test_request_with_no_worker_fails_at_its_deadline(redis_server: RedisServer, redis_url: str) -> None:
    api = start_api(redis_server, queue_deadline_s=1.0, response_cache=False)
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        start = time.monotonic()
        resp = httpx.post(api.url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "queue_deadline_exceeded"
        with httpx.stream("POST", api.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "queue_deadline_exceeded" in lines[-2] and lines[-1] == "data: [DONE]"
        assert time.monotonic() - start < 15  # 2 x (deadline 1 s + grace 0.5 s + sweep 0.5 s), with room
        assert redis.Redis.from_url(redis_url).zcard(keys.QUEUE) == 0  # nothing left to run late
    finally:
        api.stop()
