"""Admission in one atomic script: a burst of simultaneous requests never gets past the queue depth, the job it
writes is the one arq writes, no live worker is a 503 at once (or after a configured gap), and every sampled
request without a seed gets one in its queued payload."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from arq.connections import ArqRedis
from arq.jobs import deserialize_job
from redis.asyncio.connection import Connection

from api.admission import Admission
from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire import keys
from wire.messages import JobMeta, JobPayload, WorkerHeartbeat, dumps, loads
from wire.sampling import SamplingSpec

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
BURST = 40


def beat(redis_url: str, worker_id: str = "w1", active_jobs: int = 0, draining: bool = False) -> None:
    """A live worker's heartbeat, as worker.node writes it (capacity 2: --max-num-seqs 2)."""
    hb = WorkerHeartbeat(worker_id, MODEL, 2, 8192, active_jobs=active_jobs, draining=draining, time=time.time())
    r = redis.Redis.from_url(redis_url)
    r.set(keys.worker_key(worker_id), hb.to_json(), ex=30)
    r.zadd(keys.WORKERS, {worker_id: hb.time})


async def beat_seen(redis_url: str, active_jobs: int = 0, draining: bool = False) -> None:
    """``beat``, then wait until the API's heartbeat cache (0.5 s) has seen it."""
    beat(redis_url, active_jobs=active_jobs, draining=draining)
    await asyncio.sleep(0.6)


def forget(redis_url: str, worker_id: str = "w1") -> None:
    r = redis.Redis.from_url(redis_url)
    r.delete(keys.worker_key(worker_id))
    r.zrem(keys.WORKERS, worker_id)


def queued(redis_url: str) -> int:
    return int(redis.Redis.from_url(redis_url).zcard(keys.QUEUE))  # type: ignore[arg-type]


async def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def depth4_api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(redis_server, max_queue_depth=4, retry_after_s=2, queue_without_workers_s=0.0)
    yield server
    server.stop()


@pytest.mark.parametrize("running", [0, 2])
async def test_burst_of_jobs_never_passes_the_depth(depth4_api: ServerThread, redis_url: str, running: int) -> None:
    # the queue set holds the running jobs too: with 2 running, 4 more may wait
    await beat_seen(redis_url, active_jobs=running)  # the running count comes from heartbeats
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=BURST), timeout=30) as client:
        await client.get(depth4_api.url + "/health")
        for i in range(running):  # jobs "the worker runs": in the queue set, as arq keeps them
            r = redis.Redis.from_url(redis_url)
            r.zadd(keys.QUEUE, {f"running-{i}": int(time.time() * 1000)})
            r.set(keys.ARQ_IN_PROGRESS_PREFIX + f"running-{i}", b"1", ex=30)
        resps = await asyncio.gather(*(client.post(depth4_api.url + "/v1/jobs", json=BODY) for _ in range(BURST)))
    codes = [r.status_code for r in resps]
    assert codes.count(202) == 4 and codes.count(429) == BURST - 4, codes
    assert queued(redis_url) == 4 + running
    limited = next(r for r in resps if r.status_code == 429)
    assert limited.json()["error"]["code"] == "queue_full" and int(limited.headers["Retry-After"]) >= 2


async def test_burst_through_the_openai_client(depth4_api: ServerThread, redis_url: str) -> None:
    await beat_seen(redis_url)
    client = openai.AsyncOpenAI(base_url=depth4_api.url + "/v1", api_key="none", max_retries=0)
    worker = ScriptedWorker(redis_url, pieces=["ok"])
    rejected: list[openai.RateLimitError] = []

    async def one() -> str:
        try:
            return (await client.completions.create(**BODY)).choices[0].text  # type: ignore[call-overload,no-any-return]
        except openai.RateLimitError as exc:
            rejected.append(exc)
            return "429"

    tasks = [asyncio.create_task(one()) for _ in range(BURST)]
    await wait_for(lambda: len(rejected) + queued(redis_url) >= BURST)
    assert queued(redis_url) == 4 and len(rejected) == BURST - 4  # nothing was taken yet: all decided at once
    assert all(int(e.response.headers["Retry-After"]) >= 2 for e in rejected)
    await worker.serve(4)
    assert sorted(await asyncio.gather(*tasks)) == ["429"] * (BURST - 4) + ["ok"] * 4


async def test_admitted_job_is_the_one_arq_writes(redis_url: str) -> None:
    """Same job definition, expiry and queue score as ``ArqRedis.enqueue_job``, so workers take it as before."""
    pool = ArqRedis.from_url(redis_url)
    try:
        spec = SamplingSpec(seed=7)
        now = time.time()
        ours = JobPayload("ours", MODEL, [1, 2], spec, now, now + 60, events_ttl_s=120)
        theirs = JobPayload("theirs", MODEL, [1, 2], spec, now, now + 60, events_ttl_s=120)
        meta = JobMeta("completion", MODEL, int(now), 1, False, owner="k")
        assert (await Admission(pool).admit(ours, meta, 10)).outcome == "ok"
        pool.job_serializer = dumps  # type: ignore[assignment]
        await pool.enqueue_job(
            keys.JOB_FUNCTION, theirs.to_dict(), _job_id="theirs", _queue_name=keys.QUEUE, _expires=120
        )
        defs = [
            deserialize_job(await pool.get(keys.ARQ_JOB_PREFIX + i), deserializer=loads) for i in ("ours", "theirs")
        ]
        assert defs[0].function == defs[1].function and defs[0].kwargs == defs[1].kwargs == {}
        assert defs[0].job_try == defs[1].job_try is None
        assert (
            JobPayload.from_dict(defs[0].args[0]) == ours
            and abs(defs[0].enqueue_time - defs[1].enqueue_time).total_seconds() < 1
        )
        ttls = [await pool.pttl(keys.ARQ_JOB_PREFIX + i) for i in ("ours", "theirs")]
        assert abs(ttls[0] - ttls[1]) < 1500
        scores = [await pool.zscore(keys.QUEUE, i) for i in ("ours", "theirs")]
        assert scores[0] is not None and scores[1] is not None and abs(scores[0] - scores[1]) < 1000
        assert JobMeta.from_json(await pool.get(keys.job_meta_key("ours"))) == meta
        assert (await Admission(pool).admit(ours, meta, 10)).outcome == "duplicate"
        assert (await Admission(pool).admit(theirs, meta, 10)).outcome == "duplicate"  # arq's job counts too
    finally:
        await pool.aclose()


async def _post_timed(api: ServerThread, path: str = "/v1/completions") -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(api.url + path, json=BODY)
    return resp, time.monotonic() - t0


async def test_no_live_worker_is_503_at_once(depth4_api: ServerThread, redis_url: str) -> None:
    await asyncio.sleep(0.6)  # past the API's heartbeat cache
    resp, took = await _post_timed(depth4_api)
    assert resp.status_code == 503 and took < 1.0
    assert resp.json()["error"]["code"] == "no_live_worker" and int(resp.headers["Retry-After"]) >= 2
    assert queued(redis_url) == 0 and not redis.Redis.from_url(redis_url).keys(keys.PREFIX + ":job:*")
    await beat_seen(redis_url, draining=True)  # a draining worker takes nothing new
    assert (await _post_timed(depth4_api))[0].status_code == 503
    await beat_seen(redis_url)
    (resp, _), _ = await asyncio.gather(_post_timed(depth4_api), ScriptedWorker(redis_url).serve())
    assert resp.status_code == 200


async def test_queueing_without_workers_for_a_while(redis_server: RedisServer, redis_url: str) -> None:
    api = start_api(redis_server, queue_without_workers_s=1.5)
    try:
        assert (await _post_timed(api, "/v1/jobs"))[0].status_code == 202  # no worker yet, within 1.5 s of start
        await asyncio.sleep(1.6)
        assert (await _post_timed(api, "/v1/jobs"))[0].status_code == 503
        await beat_seen(redis_url)
        assert (await _post_timed(api, "/v1/jobs"))[0].status_code == 202
        forget(redis_url)  # the worker is gone: a restart's gap is allowed
        await asyncio.sleep(0.6)
        assert (await _post_timed(api, "/v1/jobs"))[0].status_code == 202
        await asyncio.sleep(1.5)
        resp = (await _post_timed(api, "/v1/jobs"))[0]
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_live_worker"
    finally:
        api.stop()


@pytest.mark.parametrize(
    ("extra", "seeded"),
    [({}, "auto"), ({"seed": 1234}, 1234), ({"temperature": 0.0}, None), ({"seed": None, "n": 2}, "auto")],
)
async def test_queued_payload_carries_a_seed(
    api: ServerThread, redis_url: str, extra: dict[str, object], seeded: object
) -> None:
    worker = ScriptedWorker(redis_url)
    async with httpx.AsyncClient(timeout=30) as client:
        resp, _ = await asyncio.gather(client.post(api.url + "/v1/completions", json={**BODY, **extra}), worker.serve())
    assert resp.status_code == 200
    seed = worker.payloads[0].params.seed
    if seeded == "auto":
        assert isinstance(seed, int) and 0 <= seed < 2**63
    else:
        assert seed == seeded


async def test_auto_seeded_requests_are_not_cached(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url)
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(2):  # the same sampled request twice: two samples, two seeds, nothing from the cache
            resp, _ = await asyncio.gather(client.post(api.url + "/v1/completions", json=BODY), worker.serve())
            assert resp.status_code == 200 and resp.headers["X-Cache"] == "miss"
            assert "seed" not in resp.json()  # the client sees no change
    seeds = [p.params.seed for p in worker.payloads]
    assert len(seeds) == 2 and seeds[0] != seeds[1]


async def test_one_round_trip_per_request(
    redis_server: RedisServer, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An uncached request costs the API one Redis round trip: the admission's EVALSHA (it was six: ZCARD, the
    meta's SET, arq's WATCH, EXISTS and MULTI/EXEC, the PUBLISH). Counted as the commands the API's thread
    sends; the heartbeat reads and the reaper's sweep run per time, not per request, and are left out."""
    api = start_api(redis_server, response_cache=False)
    sent: list[str] = []
    send = Connection.send_packed_command

    async def counting(self: Connection, command: Any, check_health: bool = True) -> None:
        if threading.current_thread() is api.thread:
            packed = command if isinstance(command, bytes | bytearray | memoryview) else b"".join(command)
            sent.append(bytes(packed).split(b"\r\n")[2].decode().upper())  # *N, $len, the command's name
        await send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counting)
    worker = ScriptedWorker(redis_url, pieces=["a"])
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(6):
                if i == 1:  # the first loaded the script (EVALSHA, NOSCRIPT, SCRIPT LOAD, EVALSHA)
                    sent.clear()
                resp, _ = await asyncio.gather(client.post(api.url + "/v1/completions", json=BODY), worker.serve())
                assert resp.status_code == 200
    finally:
        api.stop()
    assert [c for c in sent if c not in ("ZRANGEBYSCORE", "MGET")] == ["EVALSHA"] * 5, sent


def test_a_burst_that_finds_the_heartbeat_cache_stale_reads_it_once() -> None:
    """Requests of a burst that all find the 0.5 s heartbeat cache stale share one read (ZRANGEBYSCORE + MGET)
    instead of each making it; within cache_s no read, and fresh=True reads again. Counted by the server's
    command statistics, so on a server of its own: the shared one also serves what earlier tests left running."""
    with RedisServer() as server:
        _burst_reads_heartbeats_once(server.url)


def _burst_reads_heartbeats_once(redis_url: str) -> None:
    from api.jobs import JobQueue

    beat(redis_url)
    sync = redis.Redis.from_url(redis_url)

    def commands(name: str) -> int:
        return int(sync.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))

    async def burst() -> list[list[WorkerHeartbeat]]:
        client = ArqRedis.from_url(redis_url)
        queue = JobQueue(client, max_queue_depth=8, retry_after_s=1, worker_ttl_s=10.0)
        try:
            before = commands("zrangebyscore"), commands("mget")
            results = await asyncio.gather(*(queue.workers() for _ in range(64)))
            assert (commands("zrangebyscore"), commands("mget")) == (before[0] + 1, before[1] + 1)
            await queue.workers()  # fresh for cache_s: no read
            assert commands("zrangebyscore") == before[0] + 1
            await queue.workers(fresh=True)
            assert commands("zrangebyscore") == before[0] + 2
            return results
        finally:
            await client.aclose()

    results = asyncio.run(burst())
    assert all([w.worker_id for w in r] == ["w1"] for r in results)


async def test_admission_answers_from_the_response_cache_without_queueing(redis_url: str) -> None:
    """With a cache key the script returns the cached answer and writes nothing; on a miss it admits as before."""
    pool = ArqRedis.from_url(redis_url)
    try:
        now = time.time()
        meta = JobMeta("completion", MODEL, int(now), 1, False, owner="k")
        hit_job = JobPayload("hit-job", MODEL, [1, 2], SamplingSpec(), now, now + 60, events_ttl_s=120)
        await pool.set("test-cache:answer", b'{"answer": 1}')
        admitted = await Admission(pool).admit(hit_job, meta, 10, cache_key="test-cache:answer")
        assert (admitted.outcome, admitted.cached) == ("cached", b'{"answer": 1}')
        assert await pool.zscore(keys.QUEUE, "hit-job") is None
        assert not await pool.exists(keys.ARQ_JOB_PREFIX + "hit-job", keys.job_meta_key("hit-job"))
        miss_job = JobPayload("miss-job", MODEL, [1, 2], SamplingSpec(), now, now + 60, events_ttl_s=120)
        admitted = await Admission(pool).admit(miss_job, meta, 10, cache_key="test-cache:absent")
        assert (admitted.outcome, admitted.cached) == ("ok", None)
        assert await pool.zscore(keys.QUEUE, "miss-job") is not None
        assert JobMeta.from_json(await pool.get(keys.job_meta_key("miss-job"))) == meta
    finally:
        await pool.delete(keys.QUEUE, keys.ARQ_JOB_PREFIX + "miss-job", keys.job_meta_key("miss-job"))
        await pool.aclose()


async def test_cached_answer_served_when_no_worker_is_live(redis_server: RedisServer, redis_url: str) -> None:
    """An API that answers 503 at once without a live worker still serves what its cache holds (read apart from
    the admission script, which is not run then), and still refuses what it does not hold."""
    filler = start_api(redis_server)  # queues without workers: a scripted worker answers once
    strict = start_api(redis_server, queue_without_workers_s=0.0)
    try:
        worker = ScriptedWorker(redis_url, pieces=["from", " cache"])
        kwargs = {"model": MODEL, "prompt": "cache me", "max_tokens": 2, "temperature": 0.0}
        fill = openai.AsyncOpenAI(base_url=filler.url + "/v1", api_key="none", max_retries=0, timeout=10)
        first, _ = await asyncio.gather(fill.completions.create(**kwargs), worker.serve())  # type: ignore[call-overload]
        assert first.choices[0].text == "from cache"
        client = openai.AsyncOpenAI(base_url=strict.url + "/v1", api_key="none", max_retries=0, timeout=10)
        raw = await client.completions.with_raw_response.create(**kwargs)  # type: ignore[call-overload]
        assert raw.parse().choices[0].text == "from cache" and raw.headers["X-Cache"] == "hit"
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(**{**kwargs, "prompt": "not cached"})  # type: ignore[call-overload]
        assert refused.value.status_code == 503 and refused.value.body["code"] == "no_live_worker"  # type: ignore[index]
        assert redis.Redis.from_url(redis_url).zcard(keys.QUEUE) == 0
    finally:
        filler.stop()
        strict.stop()
