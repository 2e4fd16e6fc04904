"""``pagedserve bench pump`` (``python -m loadtest.pump_bench``): the worker front's cost per engine step, no engine.

The real ``GenerationWorker`` (output processor with the real tokenizer, jobs, events, one Redis pipeline per
step) against a private redis-server, fed by a stand-in for its engine core that hands it one step message at a
time: one new token for each of ``--jobs`` running jobs. Each step is handed over once the previous one is
written, so the numbers are the front's own time per step (from its pump trace: taken off the socket -> the
pipeline returned), which bounds how many streams one front can keep up with at a given engine step time.

    python -m loadtest.pump_bench --jobs 256 --steps 300            # median / p90 ms per step, us per event
    python -m loadtest.pump_bench --jobs 256 --profile pump.prof     # cProfile of the measured steps
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import modelfiles
from deploy.redis_server import RedisServer
from engine.core_messages import CoreReady, CoreStats, SeqOutput, StepOutputs
from wire.messages import JobPayload
from wire.sampling import SamplingSpec
from worker.pump_trace import ENV_VAR, sent_at

WARMUP_STEPS = 20


class StepFeed:
    """Stands in for ``worker.core_client.CoreClient``: takes the front's requests, hands it step messages."""

    def __init__(self, vocab_size: int) -> None:
        self.ready = CoreReady(4096, vocab_size, 1 << 16, [0])
        self.client = 0
        self.added: list[str] = []
        self.queue: asyncio.Queue[StepOutputs] = asyncio.Queue()

    def add(self, request_id: str, prompt: list[int], params: dict[str, Any], priority: int) -> None:
        self.added.append(request_id)

    def abort(self, request_id: str, sample_indices: list[int] | None = None) -> None:
        pass

    def has_outputs(self) -> bool:
        return not self.queue.empty()

    async def outputs(self) -> list[StepOutputs]:
        messages = [await self.queue.get()]
        while not self.queue.empty():
            messages.append(self.queue.get_nowait())
        return messages


def _token_ids(vocab_size: int, count: int) -> list[int]:
    """Ordinary tokens (no specials at the start of the vocabulary), varied so the detokenizer does real work."""
    return [(7919 * i) % (vocab_size - 1000) + 500 for i in range(count)]


async def _run(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from deploy.gc_heap import freeze_startup_heap
    from worker.front import GenerationWorker
    from worker.main import connect
    from worker.settings import WorkerSettings

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_folder or modelfiles.resolve(None).folder)
    redis = await connect(redis_url)
    feed = StepFeed(len(tokenizer))
    settings = WorkerSettings(redis_url=redis_url, max_jobs=args.jobs)
    worker = GenerationWorker(feed, settings, redis, "bench", tokenizer, CollectorRegistry())  # type: ignore[arg-type]
    assert worker.pump_trace is not None
    freeze_startup_heap()  # as run_worker does before serving
    pump = asyncio.ensure_future(worker.pump())
    now = time.time()
    spec = SamplingSpec(max_tokens=WARMUP_STEPS + args.steps + 1, ignore_eos=True)
    jobs = []
    for i in range(args.jobs):
        payload = JobPayload(f"j{i}", "bench", [1, 2, 3], spec, now, now + 3600, reply_channel="pagedserve:reply:b")
        jobs.append(asyncio.ensure_future(worker.generate({"job_try": 1}, payload.to_dict())))
    while len(feed.added) < args.jobs:
        await asyncio.sleep(0.005)
    ids = _token_ids(len(tokenizer), 997)
    profiler = cProfile.Profile() if args.profile else None
    for step in range(WARMUP_STEPS + args.steps):
        if step == WARMUP_STEPS and profiler is not None:
            profiler.enable()
        outputs = [SeqOutput(f"j{i}", 0, [ids[(step * 31 + i) % len(ids)]]) for i in range(args.jobs)]
        records = len(worker.pump_trace.records)
        await feed.queue.put(StepOutputs(outputs, CoreStats(), [], time.perf_counter()))
        while len(worker.pump_trace.records) == records:  # written: hand over the next step
            if pump.done():
                pump.result()  # the pump died: its error, not a hang
                raise RuntimeError("the pump stopped")
            await asyncio.sleep(0)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    final = await _final_step(feed, worker, jobs, ids, pump)
    pump.cancel()
    for job in jobs:
        job.cancel()
    await asyncio.gather(pump, *jobs, return_exceptions=True)
    await redis.aclose()
    measured = worker.pump_trace.records[WARMUP_STEPS:-1]  # the measured steps, not the final one
    return {"records": measured, "pauses": worker.pump_trace.gc_pauses, **final}


async def _final_step(
    feed: StepFeed, worker: Any, jobs: Sequence[asyncio.Future[Any]], ids: list[int], pump: Any
) -> dict:
    """Every job's last token in one step (a wave's end, when all its final events go out at once): that step's
    build and Redis time, and the time until every job has returned."""
    outputs = [SeqOutput(f"j{i}", 0, [ids[i % len(ids)]], None, "length") for i in range(len(jobs))]
    records = len(worker.pump_trace.records)
    start = time.perf_counter()
    await feed.queue.put(StepOutputs(outputs, CoreStats(), [], start))
    done, _ = await asyncio.wait(jobs, timeout=120)
    if pump.done():
        pump.result()
        raise RuntimeError("the pump stopped")
    all_done = time.perf_counter() - start
    last = worker.pump_trace.records[records]
    if len(done) != len(jobs) or any(j.result() != {"outcome": "ok"} for j in jobs):
        raise RuntimeError(f"{len(done)} of {len(jobs)} jobs ended after their last token")
    return {
        "final_build_ms": round(1e3 * (last.built - last.received), 3),
        "final_redis_ms": round(1e3 * (last.written - sent_at(last)), 3),
        "final_all_done_ms": round(1e3 * all_done, 3),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis:
        os.environ[ENV_VAR] = str(Path(tmp) / "pump.jsonl")
        try:
            run = asyncio.run(_run(args, redis.url))
        finally:
            os.environ.pop(ENV_VAR, None)
    records = run["records"]
    ms = sorted(1e3 * (r.written - r.received) for r in records)
    start = records[0].received if records else 0.0
    pauses = [p for p in run["pauses"] if p.start >= start]
    median = statistics.median(ms)
    return {
        "jobs": args.jobs,
        "steps": len(ms),
        "front_ms_median": round(median, 3),
        "front_ms_p90": round(ms[int(0.9 * len(ms))], 3),
        "us_per_event_median": round(1e3 * median / args.jobs, 2),
        "build_ms_median": round(statistics.median(1e3 * (r.built - r.received) for r in records), 3),
        "redis_ms_median": round(statistics.median(1e3 * (r.written - sent_at(r)) for r in records), 3),
        "events_per_step": records[0].events if records else 0,
        "gc_pauses_per_step": round(len(pauses) / max(1, len(ms)), 2),
        "gc_ms_per_step": round(1e3 * sum(p.duration_s for p in pauses) / max(1, len(ms)), 3),
        "gc_full": sum(p.generation == 2 for p in pauses),
        "gc_max_ms": round(1e3 * max((p.duration_s for p in pauses), default=0.0), 3),
        **{k: run[k] for k in ("final_build_ms", "final_redis_ms", "final_all_done_ms")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench pump", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=256, help="running jobs: one new token each per step")
    p.add_argument("--steps", type=int, default=300, help=f"measured steps (after {WARMUP_STEPS} warm-up steps)")
    p.add_argument("--profile", default="", help="write a cProfile of the measured steps here")
    p.add_argument("--tokenizer-folder", default="", help="tokenizer files from here (default: the default model's)")
    p.add_argument("--json", default="", help="write the result here")
    args = p.parse_args(argv)
    res = measure(args)
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
