"""Dense GEMV sweep (issue 11): ``python -m loadtest.gemv_bench [--tiny] [--out FILE]``.

Every variant of the Triton GEMV (``kernels.gemv``: the fma and dot kernels, tiles, stages, split-K and its
reductions, PDL) against bf16 cuBLAS (``F.linear``) in the same run, on the Llama-3-8B projection shapes
(qkv, o, gate_up, down, lm_head) at M = 1, 2, 4, 8. Each variant (aliases of one launch run once) is checked against the
torch reference (and, for the deterministic reductions, run twice for bit-equal results), then timed:
CUDA-event timing of CUDA-graph replays (``kernel_bench_common.time_graph``: warm-up, many calls per graph, the
median replay) cycling through weight copies that overflow the 50 MB L2 (each layer is 33-235 MB already;
lm_head 1 GB has one copy). GB/s counts the weight, x and the output once; "of copy" is that over the copy
bandwidth measured in the same process (a 1 GiB device-to-device copy, read + write). cuBLAS, the default
and a few variants are timed again each behind a small kernel that writes x, as in a decode step.

Printed last: per shape and M, cuBLAS and the best variant (us, fraction of the copy bandwidth, speedup);
the pairs behind a small kernel; per M, each variant's time over the best (geometric mean over the shapes),
which decides ``kernels.gemv``'s defaults; the batch-1 time per token the best variants, and the layers as
wired, would save over the 32 layers. ``--tiny`` runs every variant on CPU under the Triton interpreter at
tiny shapes (correctness only).

On the H200 (one device call; the script runs in 15-30 s, compiles included):
    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python -m loadtest.gemv_bench --out $OUT/gemv.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loadtest.kernel_bench_common import device_timer, rel_err

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when ``@triton.jit`` decorates

from kernels.gemv import GemvConfig, GemvPlan, gemv, gemv_ref, plan_gemv, scratch_is_zero  # noqa: E402

ROTATE_BYTES = 512 << 20  # weight copies cycled per graph: ~10x the L2
NUM_LAYERS = 32  # Llama-3-8B: what a token's saving is multiplied by (lm_head once)
M_VALUES = (1, 2, 4, 8)
M_VALUES_TINY = (1, 2, 5)
LAYER_SHAPES_8B = (
    ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
)  # fmt: skip
LAYER_SHAPES_TINY = (("qkv", 96, 64), ("down", 40, 200))  # 40, 200: tails along N and K
CUBLAS = "cublas"

# (name, knobs, M range). "default" is plan_gemv's launch; the others change one or two knobs of the kernel's
# default tile. fma tiles are sized for their M range: the accumulator holds M * bn * bk / (32 * warps) fp32
# registers per thread. The first H200 sweep dropped: fma past M = 2 but its default (1.3-1.9x the dot
# kernel), fma bn16 bk256 (1.13 at M = 1), fma w8 (1.13), fma s1 (1.11), fma split8 (1.46), dot bk256 s3
# (1.45), dot s6 (1.41); the later ones: dot split8 (1.20-1.27 at every M), dot bn32 (1.09-1.23), the
# L2-prefetching PDL variant (1.20-1.27).
VARIANTS: list[tuple[str, GemvConfig, tuple[int, int]]] = [
    ("default", GemvConfig(), (1, 16)),
    ("fma", GemvConfig(kernel="fma"), (1, 8)),
    ("fma bn8 bk512", GemvConfig(kernel="fma", block_n=8, block_k=512), (1, 1)),
    ("fma bn8 bk512 w2", GemvConfig(kernel="fma", block_n=8, block_k=512, num_warps=2), (1, 1)),
    ("fma bn4 bk512 w2", GemvConfig(kernel="fma", block_n=4, block_k=512, num_warps=2), (1, 2)),
    ("fma bn2 bk512 w1", GemvConfig(kernel="fma", block_n=2, block_k=512, num_warps=1), (1, 2)),
    ("fma bn4 bk1024", GemvConfig(kernel="fma", block_n=4, block_k=1024), (1, 1)),
    ("fma bn4 bk256 w2", GemvConfig(kernel="fma", block_n=4, block_k=256, num_warps=2), (1, 2)),
    ("fma bn8 bk256 w4", GemvConfig(kernel="fma", block_n=8, block_k=256, num_warps=4), (2, 2)),
    ("fma s2", GemvConfig(kernel="fma", num_stages=2), (1, 2)),
    ("fma s4", GemvConfig(kernel="fma", num_stages=4), (1, 2)),
    ("fma split2", GemvConfig(kernel="fma", split_k=2), (1, 2)),
    ("fma split4", GemvConfig(kernel="fma", split_k=4), (1, 2)),
    ("fma split4 atomic", GemvConfig(kernel="fma", split_k=4, split_reduce="atomic"), (1, 2)),
    ("fma split4 two_pass", GemvConfig(kernel="fma", split_k=4, split_reduce="two_pass"), (1, 2)),
    ("dot", GemvConfig(kernel="dot"), (1, 16)),
    ("dot split1", GemvConfig(kernel="dot", split_k=1), (1, 16)),
    ("dot split2", GemvConfig(kernel="dot", split_k=2), (1, 16)),
    ("dot split4", GemvConfig(kernel="dot", split_k=4), (1, 16)),
    ("dot split4 atomic", GemvConfig(kernel="dot", split_k=4, split_reduce="atomic"), (1, 16)),
    ("dot split4 two_pass", GemvConfig(kernel="dot", split_k=4, split_reduce="two_pass"), (1, 16)),
    ("dot s3", GemvConfig(kernel="dot", num_stages=3), (1, 16)),
    ("dot s5", GemvConfig(kernel="dot", num_stages=5), (1, 16)),
    ("dot bk64 s6", GemvConfig(kernel="dot", block_k=64, num_stages=6), (1, 16)),
    ("dot bn128 bk128 s3", GemvConfig(kernel="dot", block_n=128, block_k=128, num_stages=3), (1, 16)),
    ("dot w8", GemvConfig(kernel="dot", num_warps=8), (1, 16)),
    ("fma pdl", GemvConfig(kernel="fma", pdl=True), (1, 2)),
    ("dot pdl", GemvConfig(kernel="dot", pdl=True), (1, 16)),
]
# timed again each behind a small kernel that writes x (as a norm or an activation does in a decode step):
# what programmatic dependent launch can overlap
CHAINED = ("default", "fma", "dot", "fma pdl", "dot pdl")


def variants_at(m: int, n: int, k: int, sms: int) -> tuple[dict[str, GemvPlan], dict[str, str]]:
    """The variants that run at this shape, one per distinct launch, and the aliases (name -> the variant
    with the same launch). "default" forces the GEMV with the plan's knobs."""
    launches: dict[GemvPlan, str] = {}
    plans, aliases = {}, {}
    for name, cfg, (lo, hi) in VARIANTS:
        if not lo <= m <= hi:
            continue
        plan = plan_gemv(m, n, k, sms, cfg)
        if plan in launches:
            aliases[name] = launches[plan]
        else:
            launches[plan] = name
            plans[name] = plan
    return plans, aliases


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device copy (read + write), in this process: the figure ``loadtest.throughput``
    puts under the weight-read floor. Eager ``copy_``: captured in a CUDA graph it becomes a memcpy node run
    by the copy engines (2.7 TB/s on an H200 against 4.2 from the SMs)."""
    if device.type != "cuda":
        return float("nan")
    from loadtest.shapes import measure_copy_bandwidth

    return measure_copy_bandwidth() * 1e12


def launch_floor_us(device: torch.device, reps: int) -> dict[str, float]:
    """Time per call of a tiny GEMV and a tiny cuBLAS call (64 x 64, M = 1) back to back in a graph: what
    a launch costs before any weight is read."""
    if device.type != "cuda":
        return {}
    x = torch.randn(1, 64, dtype=torch.bfloat16, device=device)
    w = torch.randn(64, 64, dtype=torch.bfloat16, device=device)
    timer = device_timer(device)
    gemv_us = 1e6 * timer([partial(gemv, x, w, config=GemvConfig(kernel="fma", split_k=1))] * 32, reps)
    cublas_us = 1e6 * timer([partial(F.linear, x, w)] * 32, reps)
    return {"gemv": round(gemv_us, 2), CUBLAS: round(cublas_us, 2)}


def gemv_bytes(m: int, n: int, k: int, elem: int = 2) -> int:
    return elem * (n * k + m * k + m * n)


def bench_case(name: str, weights: list[torch.Tensor], m: int, reps: int, sms: int, copy_bw: float) -> dict[str, Any]:
    n, k = weights[0].shape
    device, dtype = weights[0].device, weights[0].dtype
    x = torch.randn(m, k, dtype=dtype, device=device)
    ref = gemv_ref(x, weights[0])
    plans, aliases = variants_at(m, n, k, sms)
    row: dict[str, Any] = {"layer": name, "m": m, "n": n, "k": k, "aliases": aliases, "us": {}, "err": {}}
    row["wired"] = name != "lm_head" and plan_gemv(m, n, k, sms).use_gemv  # what the dense layers run
    row["plans"] = {v: asdict(p) for v, p in plans.items()}
    timer = device_timer(device)
    tol = 1e-2
    for variant, plan in plans.items():
        fn = partial(gemv, plan=plan)
        try:
            out = fn(x, weights[0])  # compiles
            err = rel_err(out, ref)
            row["err"][variant] = float(f"{err:.1e}")
            if not err < tol:
                row.setdefault("wrong", []).append(variant)
                continue
            deterministic = plan.split_k == 1 or plan.split_reduce != "atomic"
            if deterministic and not torch.equal(fn(x, weights[0]), out):
                row.setdefault("nondeterministic", []).append(variant)
            if device.type == "cuda":
                row["us"][variant] = round(1e6 * timer([partial(fn, x, w) for w in weights], reps), 2)
        except Exception as exc:  # a variant past a resource limit (OutOfResources): skip it
            if variant == "default":
                raise
            row.setdefault("skipped", {})[variant] = f"{type(exc).__name__}: {str(exc)[:100]}"
    row["scratch_zero"] = scratch_is_zero()  # the counters (and atomic sums) left at zero
    if device.type == "cuda":
        row["us"][CUBLAS] = round(1e6 * timer([partial(F.linear, x, w) for w in weights], reps), 2)
        _add_rates(row, copy_bw)
        row["chained_us"] = _chained(x, weights, plans, row["us"], reps)
    return row


def _chained(
    x: torch.Tensor, weights: list[torch.Tensor], plans: dict[str, GemvPlan], us: dict[str, float], reps: int
) -> dict[str, float]:
    """us per (small kernel writing x, then the matmul) pair for cuBLAS and the CHAINED variants."""
    x2 = torch.empty_like(x)
    timer = device_timer(x.device)

    def pair(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        torch.mul(x, 1.0, out=x2)
        return fn(x2, w)

    fns: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {CUBLAS: F.linear}
    fns.update({v: partial(gemv, plan=plans[v]) for v in CHAINED if v in plans and v in us})
    return {v: round(1e6 * timer([partial(pair, fn, w) for w in weights], reps), 2) for v, fn in fns.items()}


def _add_rates(row: dict[str, Any], copy_bw: float) -> None:
    gb = gemv_bytes(row["m"], row["n"], row["k"]) / 1e9
    us = row["us"]
    row["gb_s"] = {v: round(gb / (t * 1e-6), 1) for v, t in us.items()}
    row["of_copy"] = {v: round(gb * 1e9 / (t * 1e-6) / copy_bw, 3) for v, t in us.items()}
    triton = {v: t for v, t in us.items() if v != CUBLAS}
    row["best"] = min(triton, key=triton.__getitem__)
    row["best_vs_cublas"] = round(us[CUBLAS] / us[row["best"]], 3)  # > 1: the GEMV is faster


def summary(rows: list[dict[str, Any]], copy_bw: float) -> list[str]:
    lines = [f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", ""]
    lines.append(f"{'layer':8s} {'M':>2s} {'cuBLAS us':>9s} {'of copy':>7s}  {'best us':>8s} {'of copy':>7s} "
                 f"{'x cuBLAS':>8s}  best / default")  # fmt: skip
    for r in rows:
        us, frac, best = r["us"], r["of_copy"], r["best"]
        lines.append(
            f"{r['layer']:8s} {r['m']:2d} {us[CUBLAS]:9.2f} {frac[CUBLAS]:7.1%}  {us[best]:8.2f} {frac[best]:7.1%} "
            f"{r['best_vs_cublas']:8.2f}  {best} / default {us.get('default', float('nan')):.2f} us"
        )
    lines += ["", "behind a small kernel that writes x (us per pair):"]
    for r in rows:
        lines.append(f"{r['layer']:8s} {r['m']:2d} " + ", ".join(f"{v} {t:.2f}" for v, t in r["chained_us"].items()))
    lines += ["", "per M: time / best variant's, geometric mean over the shapes (1.00 = best everywhere)"]
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m]
        ratios: dict[str, list[float]] = {}
        for r in at_m:
            best = r["us"][r["best"]]
            for v, t in r["us"].items():
                ratios.setdefault(v, []).append(t / best)
            for alias, target in r["aliases"].items():
                if target in r["us"]:
                    ratios.setdefault(alias, []).append(r["us"][target] / best)
        full = {v: math.exp(sum(map(math.log, x)) / len(x)) for v, x in ratios.items() if len(x) == len(at_m)}
        ranked = sorted(full.items(), key=lambda kv: kv[1])
        lines.append(f"M={m}: " + ", ".join(f"{v} {g:.2f}" for v, g in ranked))
    m1 = [r for r in rows if r["m"] == 1]
    saved = sum(
        max(0.0, r["us"][CUBLAS] - r["us"][r["best"]]) * (1 if r["layer"] == "lm_head" else NUM_LAYERS) for r in m1
    )
    lines.append(f"batch 1: the best variant where it beats cuBLAS saves {saved / 1e3:.3f} ms per token "
                 f"({NUM_LAYERS} layers + lm_head)")  # fmt: skip
    wired = [r for r in m1 if r["wired"] and "default" in r["chained_us"]]
    saved = sum((r["chained_us"][CUBLAS] - r["chained_us"]["default"]) * NUM_LAYERS for r in wired)
    lines.append(f"batch 1 as wired ({', '.join(r['layer'] for r in wired)}: plan_gemv's switch), behind a small "
                 f"kernel: {saved / 1e3:.3f} ms per token less than cuBLAS")  # fmt: skip
    bad = [(r["layer"], r["m"], r.get("wrong"), r.get("nondeterministic")) for r in rows
           if r.get("wrong") or r.get("nondeterministic") or not r["scratch_zero"]]  # fmt: skip
    lines.append(
        f"WRONG / nondeterministic / scratch not zero: {bad}" if bad else "every variant matches the reference"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.gemv_bench", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (correctness of the script)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--m", type=int, nargs="+", help="row counts (default 1 2 4 8)")
    parser.add_argument("--layers", nargs="+", help="subset of qkv o gate_up down lm_head")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("gemv_bench needs CUDA (or --tiny on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float16 if args.tiny else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    shapes = [
        s for s in (LAYER_SHAPES_TINY if args.tiny else LAYER_SHAPES_8B) if not args.layers or s[0] in args.layers
    ]
    m_values = args.m or (M_VALUES_TINY if args.tiny else M_VALUES)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    t0 = time.perf_counter()
    copy_bw = copy_bandwidth(device)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "sms": sms, "copy_bytes_per_s": copy_bw, "launch_floor_us": launch_floor_us(device, args.reps), "rows": [],
    }  # fmt: skip
    for name, n, k in shapes:
        copies = max(1, min(16, ROTATE_BYTES // (2 * n * k))) if device.type == "cuda" else 1
        weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(copies)]
        for m in m_values:
            row = bench_case(name, weights, m, 1 if args.tiny else args.reps, sms, copy_bw)
            print(json.dumps({key: row[key] for key in ("layer", "m", "us", "err") if key in row}), flush=True)
            results["rows"].append(row)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if device.type == "cuda":
        print(f"launch floor (64 x 64, M = 1, back to back in a graph): {results['launch_floor_us']} us")
        print("\n".join(summary(results["rows"], copy_bw)))
    print(f"wall {results['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
