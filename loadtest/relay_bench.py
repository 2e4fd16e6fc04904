"""``pagedserve bench relay`` (``python -m loadtest.relay_bench``): the API tier's event throughput, no engine,
each run against its own private redis-server. Needs the dev extras (psutil).

``--mode relay``: one ``EventRelay`` in this process, which only consumes; ``--publishers`` processes write one
``EventBatch`` per "engine step" (one delta for each of their jobs) as fast as they can for ``--duration`` s;
``--jobs`` readers iterate ``relay.events(sub, merge=...)`` and check every event arrives once, in order. Through
the reply channel (one message per step) and per-job channels. Profile the consumer with
``python -m cProfile -s tottime -m loadtest.relay_bench --channel reply``.

``--mode http``: the real API (``pagedserve api --api-workers N``), a fake worker process taking jobs off the arq
queue and streaming ``--deltas`` one-token deltas per job (one EventBatch per step for all running jobs), and
``--concurrency`` streaming /v1/completions clients spread over ``--client-procs`` processes.

    python -m loadtest.relay_bench --mode relay --jobs 256 --duration 10 --json relay.json
    python -m loadtest.relay_bench --mode http --concurrency 256 --api-workers 1 2 4 --client-procs 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import httpx
import psutil
import redis.asyncio as aioredis

from api.relay import EventRelay, Subscription
from deploy.redis_server import RedisServer, free_port
from wire import keys
from wire.messages import ChoiceDelta, ChoiceResult, DeltaEvent, FinalEvent, JobPayload, JobResult, loads
from wire.publisher import EventBatch

TTL_S = 600
STAMP = 17  # a relay-mode delta's text is its publish time (unix s, 17 chars): latency = arrival - oldest stamp
CTX = mp.get_context("spawn")
COUNTS = ("requests", "chunks", "tokens", "errors", "short")


def _result(job_id: str, deltas: int) -> JobResult:
    return JobResult(
        job_id, "bench", [ChoiceResult(0, "x" * deltas, [100 + i for i in range(deltas)], "length")], 1, deltas
    )


def _pct(values: list[float], q: float) -> float | None:
    return round(sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3, 2) if values else None


def _cpu_s(procs: list[psutil.Process]) -> list[float]:
    """CPU seconds (user + system) of each, 0 for one that is gone."""
    return [sum(p.cpu_times()[:2]) if p.is_running() else 0.0 for p in procs]


def _cpu_pct(before: list[float], after: list[float], wall_s: float) -> list[float]:
    return [round(100 * (b - a) / wall_s, 1) for a, b in zip(before, after, strict=True)]


def _child(fn: Callable[..., Coroutine[Any, Any, Any]], conn: Connection, *args: Any) -> None:
    conn.send(asyncio.run(fn(conn, *args)))


def _spawn(fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> tuple[Connection, mp.process.BaseProcess]:
    """``fn(conn, *args)`` in a fresh process; it says "ready", waits for "go", and its return value comes back."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_child, args=(fn, child, *args), daemon=True)
    proc.start()
    return parent, proc


def _ready(conn: Connection) -> None:
    conn.send("ready")
    conn.recv()  # "go" (blocks the loop: nothing else runs yet)


# -- mode relay ----------------------------------------------------------------------------------------------
async def _publish(conn: Connection, url: str, jobs: list[tuple[str, str]], duration_s: float) -> dict[str, float]:
    """One batch per step, one delta per job (token id = seq), then every job's final event."""
    redis = aioredis.Redis.from_url(url)
    await redis.ping()
    _ready(conn)
    t0, cpu0, step = time.monotonic(), time.process_time(), 0
    while time.monotonic() - t0 < duration_s:
        batch, stamp = EventBatch(), f"{time.time():{STAMP}.6f}"
        for job_id, channel in jobs:
            batch.add(job_id, DeltaEvent(step, [ChoiceDelta(0, stamp, [step])]), TTL_S, channel)
        await batch.execute(redis)
        step += 1
    elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
    batch = EventBatch()
    for job_id, channel in jobs:
        batch.add(job_id, FinalEvent(step, _result(job_id, 0)), TTL_S, channel)
    await batch.execute(redis)
    await redis.aclose()
    return {"steps": step, "events": step * len(jobs), "elapsed_s": elapsed, "cpu_s": cpu}


@dataclass
class ReaderStats:
    delivered: int = 0  # delta events, in order (a merged delta counts each one it joined)
    yielded: int = 0  # items the iterator gave
    final_seq: int = -1
    last_at: float = 0.0
    problems: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


async def _read(relay: EventRelay, sub: Subscription, merge: bool, stats: ReaderStats) -> None:
    async for ev in relay.events(sub, merge=merge):
        if isinstance(ev, DeltaEvent):
            ids = ev.choices[0].token_ids
            expected = list(range(stats.delivered, stats.delivered + len(ids)))
            if ids != expected:  # the first wrong one (a merged delta may hold many)
                got, want = next((a, b) for a, b in zip(ids, expected, strict=True) if a != b)
                stats.problems.append(f"{sub.job_id}: delta {got} where {want} was next")
            stats.delivered = ids[-1] + 1 if ids else stats.delivered
            stats.yielded += 1
            stats.latencies_s.append(time.time() - float(ev.choices[0].text[:STAMP]))
            stats.last_at = time.monotonic()
        elif isinstance(ev, FinalEvent):
            stats.final_seq = ev.seq
        else:
            stats.problems.append(f"{sub.job_id}: {ev}")


def check_delivery(stats: dict[str, ReaderStats], published: dict[str, int]) -> list[str]:
    """Every published delta delivered once, in order, then the final event (empty = all good)."""
    problems: list[str] = []
    for job_id, n in published.items():
        s = stats[job_id]
        problems += s.problems
        if s.delivered != n or s.final_seq != n:
            problems.append(f"{job_id}: {s.delivered} of {n} deltas delivered, final seq {s.final_seq}")
    return problems


async def run_relay(
    url: str, jobs: int, publishers: int, duration_s: float, own_channel: bool, merge: bool, redis_pid: int = 0
) -> dict[str, Any]:
    relay = EventRelay(aioredis.Redis.from_url(url))
    await relay.start()
    ids = [f"bench-{uuid.uuid4().hex[:8]}-{i}" for i in range(jobs)]
    subs = [await relay.subscribe(j, own_channel=own_channel) for j in ids]
    channels = [(j, keys.stream_channel(j) if own_channel else relay.reply_channel) for j in ids]
    pipes = [_spawn(_publish, url, channels[p::publishers], duration_s)[0] for p in range(publishers)]
    for conn in pipes:
        assert await asyncio.to_thread(conn.recv) == "ready"
    stats = {j: ReaderStats() for j in ids}
    readers = [asyncio.create_task(_read(relay, s, merge, stats[s.job_id])) for s in subs]
    procs = [psutil.Process(redis_pid)] if redis_pid else []
    t0, cpu0, redis0 = time.monotonic(), time.process_time(), _cpu_s(procs)
    for conn in pipes:
        conn.send("go")
    reports = [await asyncio.to_thread(conn.recv) for conn in pipes]
    published_at = time.monotonic()
    _, late = await asyncio.wait(readers, timeout=30 + duration_s)
    for task in late:
        task.cancel()
    wall = max(max(s.last_at for s in stats.values()), published_at) - t0
    cpu, redis_cpu = time.process_time() - cpu0, _cpu_pct(redis0, _cpu_s(procs), wall)
    await relay.stop()
    published = {j: reports[i % publishers]["steps"] for i, j in enumerate(ids)}
    problems = check_delivery(stats, published) + [f"{len(late)} readers did not finish"] * bool(late)
    delivered, latencies = sum(s.delivered for s in stats.values()), [x for s in stats.values() for x in s.latencies_s]
    num_published = sum(r["events"] for r in reports)
    return {
        **{"mode": "relay", "channel": "per-job" if own_channel else "reply", "merge": merge, "jobs": jobs},
        **{"publishers": publishers, "published": num_published, "delivered": delivered},
        "published_eps": round(num_published / max(r["elapsed_s"] for r in reports)),
        "delivered_eps": round(delivered / wall),
        "yields_per_event": round(sum(s.yielded for s in stats.values()) / max(1, delivered), 3),
        "drain_s": round(wall - (published_at - t0), 3),  # the backlog left when publishing stopped
        **{"latency_p50_ms": _pct(latencies, 0.5), "latency_p99_ms": _pct(latencies, 0.99)},
        "consumer_cpu_pct": round(100 * cpu / wall, 1),
        "consumer_us_per_event": round(1e6 * cpu / max(1, delivered), 2),
        "publisher_cpu_pct": [round(100 * r["cpu_s"] / r["elapsed_s"], 1) for r in reports],
        **{"redis_cpu_pct": redis_cpu, "num_problems": len(problems), "problems": problems[:10]},
    }


# -- mode http -----------------------------------------------------------------------------------------------
async def _take(redis: aioredis.Redis, running: dict[str, list[Any]]) -> None:
    """Jobs off the arq queue (popped: this fake is the only worker), each as [payload, next seq]."""
    ids = [job_id.decode() for job_id, _ in await redis.zpopmin(keys.QUEUE, 1024)]
    for raw in filter(None, await redis.mget([keys.ARQ_JOB_PREFIX + i for i in ids]) if ids else []):
        payload = JobPayload.from_dict(loads(raw)["a"][0])
        running[payload.request_id] = [payload, 0]


async def _fake_worker(conn: Connection, url: str, deltas: int, step_s: float) -> None:
    """A step every ``step_s`` (0: as fast as it can): one delta ("x", one token) per running job, the final last."""
    redis = aioredis.Redis.from_url(url)
    running: dict[str, list[Any]] = {}  # job id -> [payload, next seq]
    next_step = time.monotonic()
    while not conn.poll():  # anything from the parent: stop
        await asyncio.sleep(max(0.0, next_step - time.monotonic()))
        next_step = max(next_step + step_s, time.monotonic() - step_s)  # late steps are not made up in a burst
        await _take(redis, running)
        if not running:
            await asyncio.sleep(0.002)
            continue
        batch = EventBatch()
        for job_id, job in list(running.items()):
            payload, seq = job
            channel = payload.reply_channel or keys.stream_channel(job_id)
            if seq < deltas:
                batch.add(job_id, DeltaEvent(seq, [ChoiceDelta(0, "x", [100 + seq])]), payload.events_ttl_s, channel)
                job[1] += 1
            else:
                batch.add(job_id, FinalEvent(seq, _result(job_id, deltas)), payload.events_ttl_s, channel)
                del running[job_id]
        await batch.execute(redis)
    await redis.aclose()


async def _stream_one(client: httpx.AsyncClient, body: dict[str, Any], totals: dict[str, Any]) -> None:
    tokens, errors = 0, totals["error_samples"]
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if resp.status_code != 200 or '"error"' in line:
                    errors.append(f"HTTP {resp.status_code}: {line[:300]}")
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                    totals["chunks"] += bool(text)
                    tokens += len(text)
    except httpx.HTTPError as exc:
        errors.append(repr(exc))
        return
    totals["requests"] += 1
    totals["tokens"] += tokens
    totals["short"] += tokens != body["max_tokens"]


async def _clients(conn: Connection, url: str, model: str, streams: int, deltas: int, duration_s: float) -> dict:
    """``streams`` closed loops of streaming requests for ``duration_s`` (the last ones finish after it)."""
    totals: dict[str, Any] = {**dict.fromkeys(COUNTS, 0), "error_samples": []}
    body = {"model": model, "prompt": "hi", "max_tokens": deltas, "stream": True}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        _ready(conn)
        t0, cpu0 = time.monotonic(), time.process_time()

        async def loop() -> None:
            while time.monotonic() - t0 < duration_s:
                await _stream_one(client, body, totals)

        await asyncio.gather(*(loop() for _ in range(streams)))
        totals["cpu_pct"] = round(100 * (time.process_time() - cpu0) / (time.monotonic() - t0), 1)
    totals["errors"], totals["error_samples"] = len(totals["error_samples"]), totals["error_samples"][:3]
    return totals


def _start_api(redis_url: str, workers: int, port: int) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "deploy.cli", "api", "--redis-url", redis_url, "--port", str(port)]
    cmd += ["--api-workers", str(workers), "--no-response-cache", "--max-queue-depth", "1000000"]
    cmd += ["--queue-without-workers-s", "inf"]  # the fake worker sends no heartbeats
    proc = subprocess.Popen([*cmd, "--log-level", "warning"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            if resp.status_code == 200 and len(_api_procs(proc)) == workers:
                time.sleep(2.0 if workers > 1 else 0.0)  # the others may still be loading their tokenizer
                return proc, resp.json()["data"][0]["id"]
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the API did not start")


def _api_procs(api: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The processes serving requests (uvicorn's workers; its supervisor and resource tracker left out)."""
    top = psutil.Process(api.pid)
    kids = [p for p in top.children() if "resource_tracker" not in " ".join(p.cmdline())]
    return kids or [top]


def run_http(args: argparse.Namespace, redis: RedisServer, api_workers: int) -> dict[str, Any]:
    port = free_port()
    api, model = _start_api(redis.url, api_workers, port)
    stop, worker = _spawn(_fake_worker, redis.url, args.deltas, args.step_ms / 1e3)
    n, c = args.client_procs, args.concurrency
    url = f"http://127.0.0.1:{port}"
    pipes = [_spawn(_clients, url, model, c // n + (i < c % n), args.deltas, args.duration)[0] for i in range(n)]
    try:
        assert all(conn.recv() == "ready" for conn in pipes)
        procs = _api_procs(api)
        procs += [psutil.Process(p) for p in (redis.proc.pid if redis.proc else 0, worker.pid or 0)]
        t0, before = time.monotonic(), _cpu_s(procs)
        for conn in pipes:
            conn.send("go")
        reports = [conn.recv() for conn in pipes]
        wall, after = time.monotonic() - t0, _cpu_s(procs)
    finally:
        stop.send("stop")
        worker.join(10)
        api.terminate()
        api.wait(30)
    total = {k: int(sum(r[k] for r in reports)) for k in COUNTS}
    *api_cpu, redis_cpu, worker_cpu = _cpu_pct(before, after, wall)
    api_cpu_s = sum(api_cpu) / 100 * wall
    return {
        **{"mode": "http", "api_workers": api_workers, "concurrency": c, "client_procs": n, "deltas": args.deltas},
        "step_ms": args.step_ms,
        **total,
        "chunks_per_s": round(total["chunks"] / wall),
        "events_per_s": round(total["tokens"] / wall),  # one token per delta event
        "requests_per_s": round(total["requests"] / wall, 1),
        "api_cpu_pct": api_cpu,
        "api_us_per_event": round(1e6 * api_cpu_s / max(1, total["tokens"]), 1),
        "api_us_per_chunk": round(1e6 * api_cpu_s / max(1, total["chunks"]), 1),
        **{"fake_worker_cpu_pct": worker_cpu, "redis_cpu_pct": redis_cpu},
        "client_cpu_pct": [r["cpu_pct"] for r in reports],
        "error_samples": [e for r in reports for e in r["error_samples"]][:5],
    }


# -- main ----------------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["relay", "http"], default="relay")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of publishing (relay) / requests (http)")
    p.add_argument("--jobs", type=int, default=256, help="relay: subscribed jobs (one delta each per step)")
    p.add_argument("--publishers", type=int, default=1, help="relay: publisher processes (workers), jobs split")
    p.add_argument("--channel", choices=["reply", "per-job", "both"], default="both", help="relay: which path")
    p.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True, help="relay: events(merge=)")
    p.add_argument("--concurrency", type=int, default=256, help="http: concurrent streams")
    p.add_argument("--deltas", type=int, default=64, help="http: one-token deltas per job")
    p.add_argument("--step-ms", type=float, default=0.0, help="http: the fake engine's step period (0: flat out)")
    p.add_argument("--api-workers", type=int, nargs="+", default=[1, 2], help="http: one run per value")
    p.add_argument("--client-procs", type=int, default=2, help="http: client processes")
    p.add_argument("--json", default=None, help="write the results (a list) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results: list[dict[str, Any]] = []
    with RedisServer() as redis:
        pid = redis.proc.pid if redis.proc else 0
        channels = {"reply": [False], "per-job": [True], "both": [False, True]}[args.channel]
        for x in channels if args.mode == "relay" else args.api_workers:
            if args.mode == "relay":
                res = asyncio.run(run_relay(redis.url, args.jobs, args.publishers, args.duration, x, args.merge, pid))
            else:
                res = run_http(args, redis, x)
            results.append(res)
            samples = res.pop("problems", []) + res.pop("error_samples", [])
            print(" ".join(f"{k}={v}" for k, v in res.items() if k != "mode"), *samples[:5], sep="\n    ", flush=True)
            res["samples"] = samples
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any(r.get("num_problems") or r.get("errors") or r.get("short") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
