"""``pagedserve bench burst`` (``python -m loadtest.burst_bench``): how fast one worker front takes a burst of
jobs to its engine core, no engine.

``--jobs`` jobs are admitted at once through the API's own admission script (``api.admission``) into a private
redis-server; then the real ``GenerationWorker`` starts taking them (arq's loop with the batched claim, the job
function, the output processor) and hands each to a stand-in for its engine core that notes when it came. The
time from the worker's start to the last job reaching the core is what a burst of streams waits at the front
before its prefill can start (on the H200 the stack's admission ramp at 256 streams), so its per-job cost.

    python -m loadtest.burst_bench --jobs 256 --runs 3          # ms until the core has every job, us per job
    python -m loadtest.burst_bench --jobs 256 --profile b.prof  # cProfile of the front while it takes them
    python -m loadtest.burst_bench --api --jobs 64 --runs 5     # the API tier instead: one `pagedserve api`

With ``--api`` the burst is ``--jobs`` streaming ``/v1/completions`` POSTs, each on its own connection (as the
stack bench's clients send them), to one API process (``pagedserve api``, no worker: the jobs stay queued), and the
time is from the first send to the last job in the queue (its arq score: the admission's clock).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import modelfiles
from api.admission import Admission
from deploy.redis_server import RedisServer, free_port
from engine.core_messages import CoreReady, StepOutputs
from loadtest.stream_client import request_bytes
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


async def _post_burst(port: int, jobs: int, prompt_len: int) -> float:
    """``jobs`` streaming POSTs at once, each on its own connection; the unix time of the first send."""
    body = {"model": "bench", "prompt": [500 + i for i in range(prompt_len)], "max_tokens": 16, "stream": True}
    request = request_bytes(f"127.0.0.1:{port}", "/v1/completions", body)

    async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        return reader, writer

    start = time.time()
    conns = await asyncio.gather(*(one() for _ in range(jobs)))
    for reader, _ in conns:  # every request's status line: it was admitted (or refused) before this returns
        status = (await reader.readline()).decode(errors="replace")
        if " 200 " not in status:
            raise RuntimeError(f"the API answered {status.strip()!r}")
    for _, writer in conns:
        writer.close()
    return start


def measure_api(args: argparse.Namespace) -> dict[str, Any]:
    """Bursts through one API process; per run the ms from the first send to each end of the admissions."""
    import redis as redis_sync

    from wire import keys

    with RedisServer() as server:
        port = free_port()
        argv = [sys.executable, "-m", "deploy.cli", "api", "--redis-url", server.url, "--port", str(port)]
        argv += ["--served-model-name", "bench", "--queue-without-workers-s", "inf", "--disable-uvicorn-access-log"]
        api = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_sync.Redis.from_url(server.url)
        try:
            _wait_health(api, port)
            runs = []
            for _ in range(args.runs + 1):  # the first burst warms the process up: not counted
                client.delete(keys.QUEUE)
                start = asyncio.run(_post_burst(port, args.jobs, args.prompt_len))
                queued: list[tuple[bytes, float]] = client.zrange(keys.QUEUE, 0, -1, withscores=True)  # type: ignore[assignment]
                scores = sorted(score for _, score in queued)
                if len(scores) != args.jobs:
                    raise RuntimeError(f"{len(scores)} of {args.jobs} requests were queued")
                runs.append(
                    {"first_ms": round(scores[0] - 1e3 * start, 1), "all_ms": round(scores[-1] - 1e3 * start, 1)}
                )
                time.sleep(0.5)  # the aborts of the closed streams
        finally:
            api.terminate()
            api.wait(30)
    runs = runs[1:]
    return {
        "api_jobs": args.jobs,
        "runs": runs,
        "all_ms_median": statistics.median(r["all_ms"] for r in runs),
        "ms_per_request_median": round(statistics.median(r["all_ms"] for r in runs) / args.jobs, 3),
    }


def _wait_health(api: subprocess.Popen[bytes], port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if api.poll() is not None:
            raise RuntimeError(f"pagedserve api exited with {api.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("pagedserve api did not answer /health")


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
    p.add_argument("--api", action="store_true", help="the API tier's admission instead of the worker front's")
    p.add_argument("--json", default="", help="write the result here")
    args = p.parse_args(argv)
    res = measure_api(args) if args.api else measure(args)
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
