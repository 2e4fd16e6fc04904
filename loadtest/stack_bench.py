"""``pagedserve bench stack``: the whole stack (``pagedserve serve``: private Redis, API, worker) against the
engine alone, on the same requests, in one run on one machine.

At each concurrency level ``c``, ``c`` requests with fixed random prompt token ids ask for ``--output-len``
tokens each (greedy, ``ignore_eos``), all at once. First the in-process engine runs them (in a subprocess,
so its device memory is freed), then ``pagedserve serve`` is started as users start it and gets the same
token ids as streaming ``/v1/completions`` requests from ``--client-procs`` client processes.

    pagedserve bench stack --shape 8b --max-model-len 4096 --max-num-seqs 512 --out stack.json
    pagedserve bench stack --device cpu --concurrency 1 4 --output-len 8       # the default model, on CPU

Per level and side: output tok/s, TTFT p50 (to the first token: the engine step / the first SSE chunk with
text), TPOT p50 (per request (t_last - t_first) / (n - 1)), ITL p99 (gaps between token arrivals; for the
stack between SSE chunks, which may carry several tokens), the engine's mean decode step time, failures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import modelfiles
from deploy.gc_heap import freeze_heap
from engine.args import EngineArgs
from engine.step_trace import ENV_VAR as STEP_TRACE_ENV
from engine.step_trace import StepRecord, read_trace
from loadtest.hop_stats import format_hops, level_hops
from loadtest.serve_process import stop_stack, wait_ready
from loadtest.stack_probes import StackProbes, gpu_state
from loadtest.stack_profile import StackProfiler
from loadtest.stack_stats import compare, format_engine_again, format_table, summarize, worker_histograms, worker_means
from loadtest.step_stats import decode_step_p50_ms, level_ramps, print_ramps, wave_windows
from loadtest.stream_client import ClientPool, Record, StreamJob, finish_record
from loadtest.throughput import git_commit
from worker.pump_trace import ENV_VAR as PUMP_TRACE_ENV
from worker.pump_trace import read_pump_trace

WARMUP_OUTPUT_LEN = 8


def make_prompts(vocab_size: int, level: int, wave: int, prompt_len: int, seed: int) -> list[list[int]]:
    """The prompt token ids of one wave: the same on both sides, distinct across levels and waves."""
    rng = random.Random(f"{seed}-{level}-{wave}")  # str seeds hash with sha512: stable across processes
    return [[rng.randrange(10, vocab_size) for _ in range(prompt_len)] for _ in range(level)]


def num_waves(args: argparse.Namespace, level: int) -> int:
    """``--waves``, or more where a level has fewer than ``--min-requests`` requests: TTFT p50 and TPOT at
    concurrency 1 are medians over several requests, not one request's numbers."""
    return max(args.waves, -(-args.min_requests // level))


def model_vocab_size(model: str) -> int:
    folder = modelfiles.resolve(model or None).folder
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The one engine configuration both sides get: the reference builds it, the stack's worker gets its argv."""
    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )


def build_engine(args: argparse.Namespace) -> Any:
    """The engine-alone reference, its start-up heap frozen as the stack's core freezes its own (deploy.gc_heap);
    ``loadtest.throughput.close_engine`` thaws it."""
    from engine.engine import Engine

    engine = Engine(engine_args(args).create_engine_config())
    freeze_heap()
    return engine


def _num_resolved(token_ids: list[int]) -> int:
    return len(token_ids)  # resolved ids only: a step in flight is Request.num_output_placeholders


def engine_wave(
    engine: Any, prompts: list[list[int]], output_len: int, wave: int, steps: list[StepRecord] | None = None
) -> tuple[list[Record], float, int]:
    """All prompts at t=0 through ``engine.step()``; returns the records, the decode time and its steps (each
    step's record appended to ``steps``, as the stack's core traces them)."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"w{wave}-c{len(prompts)}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    by_id = {r.request_id: r for r in [*engine.scheduler.waiting, *engine.scheduler.running]}
    reqs = [by_id[rid] for rid in ids]
    times: list[list[float]] = [[] for _ in reqs]
    active = list(range(len(reqs)))
    start = time.perf_counter()
    all_started: float | None = None
    decode_steps = 0
    added = len(prompts)
    while engine.has_unfinished_requests():
        step_start, tokens = time.perf_counter(), engine.computed_tokens_total
        engine.step()
        now = time.perf_counter()
        if steps is not None:
            sched = engine.scheduler
            num_tokens = engine.computed_tokens_total - tokens
            steps.append(
                StepRecord(step_start, now - step_start, num_tokens, len(sched.running), len(sched.waiting), added)
            )
        added = 0
        for i in active:
            times[i].extend([now] * (_num_resolved(reqs[i].output_token_ids) - len(times[i])))
        active = [i for i in active if len(times[i]) < output_len]
        if all_started is not None:
            decode_steps += 1
        elif all(times):
            all_started = now
    end = time.perf_counter()
    records = []
    for i, r in enumerate(reqs):
        rec = Record(wave, i, num_tokens=_num_resolved(r.output_token_ids), start_s=start, end_s=end)
        records.append(finish_record(rec, times[i], output_len))
    return records, end - (all_started or end), decode_steps


def run_engine_only(args: argparse.Namespace) -> dict[str, Any]:
    """Every level on one engine, after a warm-up at the smallest and largest level."""
    import torch

    from loadtest.throughput import close_engine

    t0 = time.perf_counter()
    engine = build_engine(args)
    res: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 1), "vocab_size": engine.vocab_size}
    res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    res["max_num_batched_tokens"] = engine.config.scheduler.token_budget  # the device's default unless given
    print(f"engine: {res['device']}, {res['max_num_batched_tokens']} batched tokens per step", flush=True)
    try:
        for level in sorted({min(args.concurrency), max(args.concurrency)}):
            prompts = make_prompts(engine.vocab_size, level, -1, args.prompt_len, args.seed)
            engine_wave(engine, prompts, WARMUP_OUTPUT_LEN, -1)
        res["levels"] = []
        for level in args.concurrency:
            records, walls, decode_s, decode_steps = [], [], 0.0, 0
            step_records: list[StepRecord] = []
            for wave in range(num_waves(args, level)):
                prompts = make_prompts(engine.vocab_size, level, wave, args.prompt_len, args.seed)
                recs, dec_s, steps = engine_wave(engine, prompts, args.output_len, wave, step_records)
                records += recs
                walls.append(recs[0].end_s - recs[0].start_s)
                decode_s, decode_steps = decode_s + dec_s, decode_steps + steps
            summary = summarize(level, records, walls)
            summary["mean_step_ms"] = round(decode_s / decode_steps * 1e3, 3) if decode_steps else None
            summary["ramps"] = level_ramps(step_records, wave_windows(records), summary["mean_step_ms"])
            summary["decode_step_p50_ms"] = decode_step_p50_ms(step_records, wave_windows(records))
            summary["gpu_state"] = gpu_state()  # SM MHz, memory MHz, temperature, power after the level
            print(json.dumps({"engine": {k: v for k, v in summary.items() if k != "failures"}}), flush=True)
            res["levels"].append(summary)
    finally:
        close_engine(engine)
    return res


def _body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stack_levels(
    pool: ClientPool,
    args: argparse.Namespace,
    model: str,
    vocab_size: int,
    profiler: StackProfiler | None = None,
    metrics_url: str | None = None,
    probes: StackProbes | None = None,
) -> list[dict[str, Any]]:
    """The warm-up, then every level's waves through the pool (profiled from --profile-from streams on); with
    ``probes``, each level's CPU per process and thread and Redis' own latency events are printed after it."""
    for level in sorted({min(args.concurrency), max(args.concurrency)}):
        prompts = make_prompts(vocab_size, level, -1, args.prompt_len, args.seed)
        pool.run([StreamJob(-1, i, _body(model, p, WARMUP_OUTPUT_LEN)) for i, p in enumerate(prompts)])
    levels = []
    for level in args.concurrency:
        records: list[Record] = []
        walls = []
        profiling = profiler is not None and level >= args.profile_from
        if profiling:
            profiler.start(str(level))  # type: ignore[union-attr]
        hist_before = worker_histograms(metrics_url)
        if probes is not None:
            probes.start()
        for wave in range(num_waves(args, level)):
            prompts = make_prompts(vocab_size, level, wave, args.prompt_len, args.seed)
            recs = pool.run([StreamJob(wave, i, _body(model, p, args.output_len)) for i, p in enumerate(prompts)])
            walls.append(max(r.end_s for r in recs) - min(r.start_s for r in recs))
            records += recs
        if profiling:
            print("\n".join(profiler.stop()), flush=True)  # type: ignore[union-attr]
        summary = summarize(level, records, walls) | worker_means(hist_before, worker_histograms(metrics_url))
        if probes is not None:
            summary |= probes.take(level, sum(walls))
        summary["windows"] = wave_windows(records)  # for the core's step trace (ramp_stats), read after the run
        print(json.dumps({"stack": {k: v for k, v in summary.items() if k != "failures"}}), flush=True)
        levels.append(summary)
    return levels


# ---- the stack: pagedserve serve as a subprocess (loadtest.serve_process starts, waits for and stops it) ----
def run_stack(args: argparse.Namespace, vocab_size: int, log: Path) -> dict[str, Any]:
    """Start ``pagedserve serve``, wait for /ready, run every level through the client pool, stop it."""
    from deploy.redis_server import free_port

    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(port), "--log-level", args.log_level]
    argv += ["--metrics-port", str(metrics_port)]  # the (first) worker's
    argv += ["--api-workers", str(args.api_workers), "--drain-timeout-s", "30", *engine_args(args).to_argv()]
    argv += shlex.split(args.serve_args)
    res: dict[str, Any] = {"command": " ".join(["python", *argv[1:]]), "log": str(log)}
    t0 = time.perf_counter()
    res["step_trace"] = str(log.with_suffix(".steps.jsonl"))  # the core's steps (engine.step_trace)
    res["pump_trace"] = str(log.with_suffix(".pump.jsonl"))  # front 0's pipelines and GC pauses (worker.pump_trace)
    env = os.environ | {STEP_TRACE_ENV: res["step_trace"], PUMP_TRACE_ENV: res["pump_trace"]}
    env["PAGEDSERVE_SSE_TIMES"] = "1"  # the API's relay stamps (api.streams.SSE_TIMES)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        name = modelfiles.resolve(args.model or None).name
        res["ready"] = wait_ready(proc, base_url, args.ready_timeout_s, log, name)
        res["start_s"] = round(time.perf_counter() - t0, 1)
        pool = ClientPool(args.client_procs, base_url)
        profiler = StackProfiler(proc.pid, Path(args.profile_dir)) if args.profile_dir else None
        probes = StackProbes(proc.pid)
        try:
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            model = res["ready"]["model"]
            res["levels"] = stack_levels(pool, args, model, vocab_size, profiler, metrics_url, probes)
        finally:
            pool.close()
    finally:
        res["exit_status"] = stop_stack(proc)
    return res


# ---- both, side by side ---------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pagedserve bench stack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="", help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--shape", default=None, help="8b | 2b | 70b | tiny: random weights, the SmolLM2 tokenizer")
    p.add_argument("--tokenizer-folder", default=None, help="--shape: tokenizer files from here (default: SmolLM2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256, 512])
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--waves", type=int, default=1, help="waves of `concurrency` requests per level")
    p.add_argument("--min-requests", type=int, default=8, help="more waves where a level has fewer requests")
    p.add_argument("--seed", type=int, default=0, help="of the prompt token ids")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)))
    p.add_argument("--api-workers", type=int, default=1)
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--log-level", default="warning", help="of pagedserve serve (its log goes next to --out)")
    p.add_argument("--serve-args", default="", help='more flags for pagedserve serve: --serve-args="--workers 2"')
    g = p.add_argument_group("engine (both sides get the same)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest --concurrency")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the server's (by device)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--cpu-kv-cache-gib", type=float, default=1.0)
    g.add_argument("--load-format", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile-dir", default=None, help="py-spy the stack's processes during levels, to here")
    p.add_argument("--profile-from", type=int, default=256, help="profile the levels of this many streams and more")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--commit", default=None, help="git commit to record (when .git is not at hand)")
    p.add_argument("--engine-only", action="store_true", help="internal: the engine side only, JSON to --out")
    p.add_argument("--engine-again", action="store_true", help="run the engine reference again after the stack")
    args = p.parse_args(argv)
    if args.output_len < 2 or args.waves < 1 or args.min_requests < 1 or min(args.concurrency) < 1:
        p.error("--output-len must be >= 2, --waves, --min-requests and every --concurrency >= 1")
    if args.shape and args.model and not args.engine_only:  # the engine side gets the shape's folder as --model
        p.error("give --model or --shape, not both")
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    return args


def run_engine_subprocess(argv: list[str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The engine side in its own process, so its device memory is free before the stack starts."""
    flags = ["--model", args.model, "--load-format", args.load_format, "--max-num-seqs", str(args.max_num_seqs)]
    cmd = [sys.executable, "-m", "loadtest.stack_bench", *argv, *flags, "--engine-only", "--out", str(out)]
    status = subprocess.run(cmd, check=False).returncode
    if status != 0:
        raise RuntimeError(f"the engine reference exited with {status}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_both(argv: list[str], args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """Engine reference, then the stack; a stack that fails to start is recorded with its log's tail.
    ``base``.engine.json and ``base``.serve.log are written beside the result."""
    res: dict[str, Any] = {"date": str(date.today()), "commit": args.commit or git_commit()}
    res["command"] = "pagedserve bench stack " + " ".join(argv)
    res["model"], res["shape"] = args.model or "SmolLM2-135M-Instruct (default)", args.shape
    res["config"] = {k: v for k, v in vars(args).items() if k not in ("engine_only", "commit")}
    res["engine"] = run_engine_subprocess(argv, args, base.with_suffix(".engine.json"))
    try:
        res["stack"] = run_stack(args, model_vocab_size(args.model), base.with_suffix(".serve.log"))
    except RuntimeError as exc:
        res["stack"] = {"error": str(exc), "log": str(base.with_suffix(".serve.log"))}
    if args.engine_again:  # the same reference after the stack: did the machine change, or is it the process?
        res["engine_again"] = run_engine_subprocess(argv, args, base.with_suffix(".engine2.json"))
    if "levels" in res["stack"]:
        res["levels"] = compare(res["engine"]["levels"], res["stack"]["levels"])
        steps = read_trace(res["stack"]["step_trace"])
        pumps, pauses = read_pump_trace(res["stack"]["pump_trace"])
        for eng, stack in zip(res["engine"]["levels"], res["stack"]["levels"], strict=True):
            windows = stack.pop("windows")
            stack["ramps"] = level_ramps(steps, windows, eng["mean_step_ms"])
            stack["decode_step_p50_ms"] = decode_step_p50_ms(steps, windows)
            stack["front"] = level_hops(pumps, pauses, windows)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.engine_only:
        Path(args.out).write_text(json.dumps(run_engine_only(args), indent=1))
        return 0
    folder = None
    if args.shape:
        from loadtest.shapes import shape_folder_with_tokenizer

        folder = shape_folder_with_tokenizer(
            args.shape, args.max_model_len or 4096, tokenizer_folder=args.tokenizer_folder
        )
        args.model, args.load_format = str(folder), "dummy"
    base = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="pagedserve-stack-")) / "stack"
    base.parent.mkdir(parents=True, exist_ok=True)
    try:
        res = run_both(argv, args, base)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    if "levels" in res:
        print_ramps(res)
        if "engine_again" in res:
            print(format_engine_again(res))
        for level in res["stack"]["levels"]:
            print(format_hops(level["concurrency"], level["front"]))
        print(format_table(res["levels"]))
    failures = [f for lv in res.get("stack", {}).get("levels", []) + res["engine"]["levels"] for f in lv["failures"]]
    for f in failures[:20]:
        print("FAILED", json.dumps(f))
    if "error" in res["stack"]:
        print("STACK FAILED:", res["stack"]["error"], file=sys.stderr)
    return 0 if "levels" in res and not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
