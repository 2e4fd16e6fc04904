"""``pagedserve bench burst`` (``python -m loadtest.burst_bench``): how fast one worker front takes a burst of
jobs to its engine core, no engine.

``--jobs`` jobs are admitted at once through the API's own admission script (``api.admission``) into a private
redis-server; then the real ``GenerationWorker`` starts taking them (arq's loop with the batched claim, the job
function, the output processor) and hands each to a stand-in for its engine core that notes when it came. The
time from the worker's start to the last job reaching the core is what a burst of streams waits at the front
before its prefill can start (on the H200 the stack's admission ramp at 256 streams), so its per-job cost.

    python -m loadtest.burst_bench --jobs 256 --runs 3          # ms until the core has every job, us per job
    python -m loadtest.burst_bench --jobs 256 --profile b.prof  # cProfile of the front while it takes them
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import statistics
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import modelfiles
from api.admission import Admission
from deploy.redis_server import RedisServer
from engine.core_messages import CoreReady, StepOutputs
from wire.messages import JobMeta, JobPayload
from wire.sampling import SamplingSpec


class AddClock:
    """Stands in for ``worker.core_client.CoreClient``: notes when each request reaches it, emits no steps."""

    def __init__(self, vocab_size: int) -> None:
        self.ready = CoreReady(4096, vocab_size, 1 << 16, [0])
        self.client = 0
        self.added: list[float] = []
        self.ids: list[str] = []
        self.all_added = asyncio.Event()
        self.expected = 0

    def add(self, request_id: str, prompt: list[int], params: dict[str, Any], priority: int) -> None:
        self.added.append(time.perf_counter())
        self.ids.append(request_id)
        if len(self.added) == self.expected:
            self.all_added.set()

    def abort(self, request_id: str, sample_indices: list[int] | None = None) -> None:
        pass

    def has_outputs(self) -> bool:
        return False

    async def outputs(self) -> list[StepOutputs]:
        await asyncio.Event().wait()  # never: no engine
        return []


async def _admit(redis: Any, jobs: int, prompt_len: int, tag: str) -> None:
    admission = Admission(redis)
    now = time.time()
    spec = SamplingSpec(max_tokens=256, ignore_eos=True)
    prompt = [500 + (7 * i) % 20000 for i in range(prompt_len)]
    for i in range(jobs):
        rid = f"{tag}-{i}"
        payload = JobPayload(rid, "bench", prompt, spec, now, now + 3600, stream=True, reply_channel=f"r:{rid}")
        meta = JobMeta("completion", "bench", int(now), 1, False)
        admitted = await admission.admit(payload, meta, 1 << 20)
        assert admitted.outcome == "ok", admitted


async def _run_once(args: argparse.Namespace, redis_url: str, tokenizer: Any, tag: str) -> dict[str, Any]:
    from worker.front import GenerationWorker
    from worker.main import connect, prewarm
    from worker.settings import WorkerSettings

    redis = await connect(redis_url)
    await redis.flushall()
    await _admit(redis, args.jobs, args.prompt_len, tag)
    clock = AddClock(len(tokenizer))
    clock.expected = args.jobs
    settings = WorkerSettings(redis_url=redis_url, max_jobs=args.jobs, worker_id=f"burst-{tag}")
    worker = GenerationWorker(clock, settings, redis, "bench", tokenizer, CollectorRegistry())  # type: ignore[arg-type]
    await prewarm(redis, args.jobs)
    profiler = cProfile.Profile() if args.profile else None
    arq = worker.arq_worker()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    main = asyncio.ensure_future(worker.run_arq(arq))
    try:
        await asyncio.wait_for(clock.all_added.wait(), 120)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        main.cancel()
        for task in list(arq.tasks.values()):
            task.cancel()
        await asyncio.gather(main, *arq.tasks.values(), return_exceptions=True)
        await redis.aclose()
    gaps = [b - a for a, b in zip(clock.added, clock.added[1:], strict=False)]
    return {
        "reached": sorted(clock.ids) == sorted(f"{tag}-{i}" for i in range(args.jobs)),  # each job once
        "first_ms": round(1e3 * (clock.added[0] - start), 3),
        "all_ms": round(1e3 * (clock.added[-1] - start), 3),
        "us_per_job": round(1e6 * (clock.added[-1] - clock.added[0]) / max(1, args.jobs - 1), 1),
        "max_gap_ms": round(1e3 * max(gaps, default=0.0), 3),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_folder or modelfiles.resolve(None).folder)
    with RedisServer() as redis:
        runs = [asyncio.run(_run_once(args, redis.url, tokenizer, f"r{k}")) for k in range(args.runs)]
    return {
        "jobs": args.jobs,
        "all_reached": all(r["reached"] for r in runs),
        "runs": runs,
        "all_ms_median": round(statistics.median(r["all_ms"] for r in runs), 3),
        "us_per_job_median": round(statistics.median(r["us_per_job"] for r in runs), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench burst", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=256, help="jobs queued at once")
    p.add_argument("--prompt-len", type=int, default=20, help="prompt token ids per job")
    p.add_argument("--runs", type=int, default=3, help="bursts, each on a fresh worker")
    p.add_argument("--profile", default="", help="write a cProfile of the (last) burst's intake here")
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
