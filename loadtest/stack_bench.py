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
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx

import modelfiles
from engine.args import EngineArgs
from loadtest.stack_profile import StackProfiler
from loadtest.stream_client import ClientPool, Record, StreamJob, finish_record

WARMUP_OUTPUT_LEN = 8


def make_prompts(vocab_size: int, level: int, wave: int, prompt_len: int, seed: int) -> list[list[int]]:
    """The prompt token ids of one wave: the same on both sides, distinct across levels and waves."""
    rng = random.Random(f"{seed}-{level}-{wave}")  # str seeds hash with sha512: stable across processes
    return [[rng.randrange(10, vocab_size) for _ in range(prompt_len)] for _ in range(level)]


def model_vocab_size(model: str) -> int:
    folder = modelfiles.resolve(model or None).folder
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)]  # nearest rank


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def gaps_after_ramp(records: list[Record]) -> list[float]:
    """The gaps that end after every request of their wave had its first token: ITL without the admission
    ramp (requests still arriving add prefill work to the steps), to tell ramp stalls from steady ones."""
    ramp_end: dict[int, float] = {}
    for r in records:
        if r.ttft_s is not None:
            ramp_end[r.wave] = max(ramp_end.get(r.wave, 0.0), r.start_s + r.ttft_s)
    out = []
    for r in records:
        if r.ttft_s is None:
            continue
        t = r.start_s + r.ttft_s
        for gap in r.gaps_s:
            t += gap
            if t > ramp_end[r.wave]:
                out.append(gap)
    return out


def summarize(level: int, records: list[Record], walls_s: list[float]) -> dict[str, Any]:
    """One side's numbers at one level; failed requests listed with their reason."""
    ok = [r for r in records if r.reason is None]
    gaps = [g for r in ok for g in r.gaps_s]
    wall_s = sum(walls_s)
    return {
        "concurrency": level,
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "wall_s": round(wall_s, 4),
        "output_tokens": sum(r.num_tokens for r in ok),
        "output_tok_s": round(sum(r.num_tokens for r in ok) / wall_s, 1) if wall_s > 0 else 0.0,
        "ttft_p50_ms": _ms(_pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.5)),
        "ttft_p99_ms": _ms(_pct([r.ttft_s for r in ok if r.ttft_s is not None], 0.99)),
        "tpot_p50_ms": _ms(_pct([r.tpot_s for r in ok if r.tpot_s is not None], 0.5)),
        "itl_p50_ms": _ms(_pct(gaps, 0.5)),
        "itl_p99_ms": _ms(_pct(gaps, 0.99)),
        "itl_p99_after_ramp_ms": _ms(_pct(gaps_after_ramp(ok), 0.99)),
        "arrivals_per_request": round(statistics.fmean(len(r.gaps_s) + 1 for r in ok), 2) if ok else None,
        "failures": [{"wave": r.wave, "index": r.index, "reason": r.reason} for r in records if r.reason],
    }


# ---- the engine alone (run in a subprocess: python -m loadtest.stack_bench --engine-only ...) ----------------
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
    from engine.engine import Engine

    return Engine(engine_args(args).create_engine_config())


def _num_resolved(token_ids: list[int]) -> int:
    return len(token_ids)  # resolved ids only: a step in flight is Request.num_output_placeholders


def engine_wave(engine: Any, prompts: list[list[int]], output_len: int, wave: int) -> tuple[list[Record], float, int]:
    """All prompts at t=0 through ``engine.step()``; returns the records, the decode time and its steps."""
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
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
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

    t0 = time.perf_counter()
    engine = build_engine(args)
    res: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 1), "vocab_size": engine.vocab_size}
    res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    try:
        for level in sorted({min(args.concurrency), max(args.concurrency)}):
            prompts = make_prompts(engine.vocab_size, level, -1, args.prompt_len, args.seed)
            engine_wave(engine, prompts, WARMUP_OUTPUT_LEN, -1)
        res["levels"] = []
        for level in args.concurrency:
            records, walls, decode_s, decode_steps = [], [], 0.0, 0
            for wave in range(args.waves):
                prompts = make_prompts(engine.vocab_size, level, wave, args.prompt_len, args.seed)
                recs, dec_s, steps = engine_wave(engine, prompts, args.output_len, wave)
                records += recs
                walls.append(recs[0].end_s - recs[0].start_s)
                decode_s, decode_steps = decode_s + dec_s, decode_steps + steps
            summary = summarize(level, records, walls)
            summary["mean_step_ms"] = round(decode_s / decode_steps * 1e3, 3) if decode_steps else None
            print(json.dumps({"engine": {k: v for k, v in summary.items() if k != "failures"}}), flush=True)
            res["levels"].append(summary)
    finally:
        engine.shutdown()
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


# the worker's own view of a request's start (its --metrics-port): enqueue -> taken, enqueue -> first token
_WORKER_TIMES = {
    "worker_queue_mean_ms": "pagedserve:worker_queue_time_seconds",
    "worker_ttft_mean_ms": "pagedserve:worker_time_to_first_token_seconds",
}


def worker_histograms(metrics_url: str | None) -> dict[str, tuple[float, float]]:
    """(sum, count) of the worker's start-time histograms, to split the stack's TTFT by where it went."""
    if metrics_url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return {}
    found: dict[str, list[float]] = {name: [0.0, 0.0] for name in _WORKER_TIMES.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, acc in found.items():
                if sample.name == name + "_sum":
                    acc[0] += sample.value
                elif sample.name == name + "_count":
                    acc[1] += sample.value
    return {name: (acc[0], acc[1]) for name, acc in found.items()}


def worker_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Per-level means (ms) of the worker's histograms, from two scrapes."""
    out: dict[str, Any] = {}
    for key, name in _WORKER_TIMES.items():
        if name in before and name in after and after[name][1] > before[name][1]:
            out[key] = round(1e3 * (after[name][0] - before[name][0]) / (after[name][1] - before[name][1]), 2)
    return out


def stack_levels(
    pool: ClientPool,
    args: argparse.Namespace,
    model: str,
    vocab_size: int,
    profiler: StackProfiler | None = None,
    metrics_url: str | None = None,
) -> list[dict[str, Any]]:
    """The warm-up, then every level's waves through the pool (profiled from --profile-from streams on)."""
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
        for wave in range(args.waves):
            prompts = make_prompts(vocab_size, level, wave, args.prompt_len, args.seed)
            recs = pool.run([StreamJob(wave, i, _body(model, p, args.output_len)) for i, p in enumerate(prompts)])
            walls.append(max(r.end_s for r in recs) - min(r.start_s for r in recs))
            records += recs
        if profiling:
            print("\n".join(profiler.stop()), flush=True)  # type: ignore[union-attr]
        summary = summarize(level, records, walls) | worker_means(hist_before, worker_histograms(metrics_url))
        print(json.dumps({"stack": {k: v for k, v in summary.items() if k != "failures"}}), flush=True)
        levels.append(summary)
    return levels


# ---- the stack: pagedserve serve as a subprocess ----------------------------------------------------------
def _tail(path: Path, num_chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


def wait_ready(
    proc: subprocess.Popen[bytes], base_url: str, timeout_s: float, log: Path, default_model: str
) -> dict[str, Any]:
    """Poll /ready until a worker is live; the served model's id from /v1/models (``default_model`` if refused)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedserve serve exited with {proc.returncode} before ready:\n{_tail(log)}")
        try:
            ready = httpx.get(f"{base_url}/ready", timeout=5)
            if ready.status_code == 200:
                models = httpx.get(f"{base_url}/v1/models", timeout=5)
                model = models.json()["data"][0]["id"] if models.status_code == 200 else default_model
                return {**ready.json(), "model": model}
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"pagedserve serve not ready after {timeout_s:.0f} s:\n{_tail(log)}")


def stop_stack(proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> int:
    """SIGINT (Ctrl-C) as a user stops it; SIGKILL only if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


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
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        name = modelfiles.resolve(args.model or None).name
        res["ready"] = wait_ready(proc, base_url, args.ready_timeout_s, log, name)
        res["start_s"] = round(time.perf_counter() - t0, 1)
        pool = ClientPool(args.client_procs, base_url)
        profiler = StackProfiler(proc.pid, Path(args.profile_dir)) if args.profile_dir else None
        try:
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            res["levels"] = stack_levels(pool, args, res["ready"]["model"], vocab_size, profiler, metrics_url)
        finally:
            pool.close()
    finally:
        res["exit_status"] = stop_stack(proc)
    return res


# ---- both, side by side ---------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(engine: list[dict[str, Any]], stack: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: stack / engine throughput, both sides' latencies, the stack's ITL p99 in engine steps."""
    rows = []
    for e, s in zip(engine, stack, strict=True):
        row: dict[str, Any] = {"concurrency": e["concurrency"], "engine_step_ms": e["mean_step_ms"]}
        for key in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "itl_p99_after_ramp_ms", "failed"):
            row[f"engine_{key}"], row[f"stack_{key}"] = e[key], s[key]
        for key in _WORKER_TIMES:
            row[key] = s.get(key)
        row["tok_s_ratio"] = _ratio(s["output_tok_s"], e["output_tok_s"])
        row["stack_itl_p99_over_step"] = _ratio(s["itl_p99_ms"], e["mean_step_ms"])
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table of ``compare``'s rows."""
    cols = [("conc", "concurrency"), ("tok/s eng", "engine_output_tok_s"), ("tok/s stack", "stack_output_tok_s")]
    cols += [("ratio", "tok_s_ratio"), ("TTFT50 eng", "engine_ttft_p50_ms"), ("TTFT50 stack", "stack_ttft_p50_ms")]
    cols += [("TPOT50 eng", "engine_tpot_p50_ms"), ("TPOT50 stack", "stack_tpot_p50_ms")]
    cols += [("ITL99 eng", "engine_itl_p99_ms"), ("ITL99 stack", "stack_itl_p99_ms"), ("step eng", "engine_step_ms")]
    cols += [("ITL99 ramped", "stack_itl_p99_after_ramp_ms")]
    cols += [("ITL99/step", "stack_itl_p99_over_step"), ("fail eng", "engine_failed"), ("fail stack", "stack_failed")]
    cols += [("queue mean", "worker_queue_mean_ms"), ("wTTFT mean", "worker_ttft_mean_ms")]
    cell = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) and abs(v) < 1e4 else f"{v:.0f}"  # noqa: E731
    widths = [max(len(title), *(len(cell(r[key])) for r in rows)) for title, key in cols]
    lines = ["  ".join(t.rjust(w) for (t, _), w in zip(cols, widths, strict=True))]
    lines += ["  ".join(cell(r[k]).rjust(w) for (_, k), w in zip(cols, widths, strict=True)) for r in rows]
    return "\n".join(lines) + (
        "\n(times in ms; ratio = stack / engine; ITL99/step = stack ITL p99 / engine step; ITL99 ramped: the"
        " stack's gaps after every request of the wave had its first token; queue / wTTFT mean: the"
        " worker's enqueue -> job start / -> first token, per level)"
    )


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
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--cpu-kv-cache-gib", type=float, default=1.0)
    g.add_argument("--load-format", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--profile-dir", default=None, help="py-spy the stack's processes during levels, to here")
    p.add_argument("--profile-from", type=int, default=256, help="profile the levels of this many streams and more")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--commit", default=None, help="git commit to record (when .git is not at hand)")
    p.add_argument("--engine-only", action="store_true", help="internal: the engine side only, JSON to --out")
    args = p.parse_args(argv)
    if args.output_len < 2 or args.waves < 1 or min(args.concurrency) < 1:
        p.error("--output-len must be >= 2, --waves and every --concurrency >= 1")
    if args.shape and args.model and not args.engine_only:  # the engine side gets the shape's folder as --model
        p.error("give --model or --shape, not both")
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    return args


def _git_commit() -> str:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return git.stdout.strip() or "unknown"


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
    res: dict[str, Any] = {"date": str(date.today()), "commit": args.commit or _git_commit()}
    res["command"] = "pagedserve bench stack " + " ".join(argv)
    res["model"], res["shape"] = args.model or "SmolLM2-135M-Instruct (default)", args.shape
    res["config"] = {k: v for k, v in vars(args).items() if k not in ("engine_only", "commit")}
    res["engine"] = run_engine_subprocess(argv, args, base.with_suffix(".engine.json"))
    try:
        res["stack"] = run_stack(args, model_vocab_size(args.model), base.with_suffix(".serve.log"))
    except RuntimeError as exc:
        res["stack"] = {"error": str(exc), "log": str(base.with_suffix(".serve.log"))}
    if "levels" in res["stack"]:
        res["levels"] = compare(res["engine"]["levels"], res["stack"]["levels"])
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
        print(format_table(res["levels"]))
    failures = [f for lv in res.get("stack", {}).get("levels", []) + res["engine"]["levels"] for f in lv["failures"]]
    for f in failures[:20]:
        print("FAILED", json.dumps(f))
    if "error" in res["stack"]:
        print("STACK FAILED:", res["stack"]["error"], file=sys.stderr)
    return 0 if "levels" in res and not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
