"""Where a whole workload's time goes on the device: ``python -m loadtest.run_profile --shape 8b --workload mixed``.

One engine runs the workload once unprofiled (its wall time) and once under torch.profiler with CUDA activity only
(CUPTI sees the kernels inside CUDA graphs). Every kernel's device time is summed by category (GEMMs, prefill and
decode attention, norms, the activation, rotary + cache write, sampling, copies, the rest), and the device's idle
time is the wall time minus the busy time (kernels do not overlap on the engine's one stream). Against the suite's
MFU this says which part of ``mixed`` is short of its bound: the GEMMs' rate, the attention's bandwidth, the small
kernels, or the host.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import time
from typing import Any

import torch

from loadtest.throughput import build_engine, close_engine, parse, run_engine, sync
from loadtest.workloads import BenchRequest, make_workload

# (category, substrings of the kernel's name, lower case), first match wins
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "splitk")),
    ("prefill_attention", ("prefill",)),
    ("decode_attention", ("decode",)),
    ("rms_norm", ("rms_norm",)),
    ("silu_and_mul", ("silu",)),
    ("rope_and_cache", ("rope", "cache_kernel")),
    ("sampling", ("argmax", "sampl", "topk", "sort", "softmax", "multinomial", "exponential")),
    ("copies", ("memcpy", "memset", "copy")),
]


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def idle_gaps(spans: list[tuple[float, float, str]], top: int = 8) -> dict[str, Any]:
    """Where the device idles between kernels: ``spans`` are kernels' (start us, end us, name) on the device's
    timeline. Each gap (after the union of the spans so far) is charged to the kernel that ends it and the one
    before it (so a step boundary shows as a sampling kernel before and the next step's first kernel after), and
    binned by length."""
    bins = {"<10us": 0.0, "10-100us": 0.0, "100us-1ms": 0.0, ">=1ms": 0.0}
    by_next: dict[str, float] = {}  # gap us by the kernel that ends it
    by_prev: dict[str, float] = {}  # and by the kernel before it
    gaps: list[tuple[float, float]] = []  # (gap us, its start in ms from the first kernel)
    first = min((s for s, _, _ in spans), default=0.0)
    end, prev = None, ""
    for start, stop, name in sorted(spans):
        if end is not None and start > end:
            gap = start - end
            gaps.append((gap, (end - first) / 1e3))
            bins["<10us" if gap < 10 else "10-100us" if gap < 100 else "100us-1ms" if gap < 1000 else ">=1ms"] += gap
            by_next[name[:60]] = by_next.get(name[:60], 0.0) + gap
            by_prev[prev[:60]] = by_prev.get(prev[:60], 0.0) + gap
        if end is None or stop > end:
            end, prev = stop, name

    def biggest(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v / 1e6, 6) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}

    return {
        "gaps": len(gaps), "gaps_over_1ms": sum(g >= 1000 for g, _ in gaps), "idle_s": round(sum(bins.values()) / 1e6, 6),
        "by_length_s": {k: round(v / 1e6, 6) for k, v in bins.items()},
        "before_kernel_s": biggest(by_next), "after_kernel_s": biggest(by_prev),
        "longest": [{"us": round(g, 1), "at_ms": round(t, 1)} for g, t in heapq.nlargest(top, gaps)],
    }  # fmt: skip


class GcPauses:
    """Python's garbage collections while it is active: count, total and longest seconds per generation."""

    def __init__(self) -> None:
        self.stats: dict[int, list[float]] = {}
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.stats.setdefault(info["generation"], []).append(time.perf_counter() - self._t0)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            f"gen{g}": {"count": len(d), "total_s": round(sum(d), 4), "max_s": round(max(d), 4)}
            for g, d in sorted(self.stats.items())
        }


def profile_run(engine: Any, reqs: list[BenchRequest], top: int) -> dict[str, Any]:
    """The workload's wall time unprofiled, then its kernels' device time by category under the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with GcPauses() as pauses:
        plain = run_engine(engine, reqs, "plain")
    engine.kv.reset_prefix_cache()
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        profiled = run_engine(engine, reqs, "prof")
        sync(engine)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
    by_cat: dict[str, float] = {}
    for e in kernels:
        by_cat[category(e.key)] = by_cat.get(category(e.key), 0.0) + e.self_device_time_total / 1e6
    busy = sum(by_cat.values())
    rows = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if getattr(e, "device_type", None) == DeviceType.CUDA
    ]
    return {
        "elapsed_s": plain["elapsed_s"],
        "steps": plain["steps"],
        "output_tok_s": plain["output_tok_s"],
        "profiled_wall_s": round(wall, 3),
        "profiled_elapsed_s": profiled["elapsed_s"],
        "device_busy_s": round(busy, 3),
        "device_idle_s": round(wall - busy, 3),
        "by_category_s": {k: round(v, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top": [{"name": e.key[:100], "calls": e.count, "s": round(e.self_device_time_total / 1e6, 4)} for e in rows],
        "idle_gaps": idle_gaps(spans),
        "gc_unprofiled_run": pauses.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--top", type=int, default=20)
    extra.add_argument("--no-gc-freeze", action="store_true", help="thaw the heap build_engine froze (the A/B)")
    known, rest = extra.parse_known_args(argv)
    args = parse(["throughput", *rest])  # the bench's engine flags (--shape, --max-num-seqs, ...)
    engine = build_engine(args)
    vocab = engine.vocab_size
    warm = [BenchRequest(r.prompt_token_ids[::-1], r.max_tokens) for r in make_workload("mixed", vocab, 16)]
    run_engine(engine, warm, "warm")  # compiles outside the timed runs, as the suite does
    if known.no_gc_freeze:
        gc.unfreeze()
    res = profile_run(engine, make_workload(args.workload, vocab, args.num_requests), known.top)
    res.update(workload=args.workload, shape=args.shape, max_num_seqs=args.max_num_seqs)
    close_engine(engine)
    print(json.dumps({k: v for k, v in res.items() if k not in ("top", "idle_gaps", "gc_unprofiled_run")}), flush=True)
    print("idle between kernels:", json.dumps(res["idle_gaps"]), flush=True)
    print("garbage collections in the unprofiled run:", json.dumps(res["gc_unprofiled_run"]), flush=True)
    for row in res["top"]:
        print(f"  {row['s']:8.3f} s {row['calls']:7d}x {row['name']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
