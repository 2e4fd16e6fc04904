"""Where `mixed`'s GEMM time goes (issue 11's MFU): ``python -m loadtest.gemm_probe [--out FILE]``.

The engine's dense projections are ``F.linear(x, W)`` on cuBLAS. Session 12's profile of `mixed` put them at
9.24 s, 0.82 of the 8k x 8k matmul rate. This times the Llama-3-8B layer GEMMs (qkv, o, gate_up, down) at the
M that `mixed`'s steps have (decode batches of up to 512 sequences, 8192-token prefill steps) under each BLAS
backend torch offers (``torch.backends.cuda.preferred_blas_library``: cuBLAS, cuBLASLt), each against the
8k x 8k rate of the same run, and adds them up the way `mixed` runs them: ~33 steps of 8192 tokens, then one
decode step per batch size from ~480 down to 1 (outputs U[16, 512], all 512 requests admitted in the prompt
phase). ``--autotune`` also times Inductor's max-autotune choice (its Triton templates against aten) at a few M.

CUDA-graph replays (``kernel_bench_common.time_graph``) of one layer's four GEMMs cycling through weight copies
that overflow the 50 MB L2, as the 32 layers of a step do.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.cuda_graphs import batch_size_ladder
from loadtest.kernel_bench_common import ROTATE_BYTES, time_graph
from loadtest.shapes import measure_matmul_tflops

LAYERS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
M_VALUES = (1, 16, 64, 128, 192, 256, 320, 384, 448, 512, 1024, 2048, 4096, 8192)
BACKENDS = ("cublas", "cublaslt")
PREFILL_STEPS, PREFILL_M, DECODE_MAX = 33, 8192, 480  # `mixed` at --max-num-batched-tokens 8192 (see docstring)


def layer_weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def time_layer(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor]
) -> float:
    calls = [lambda w=w: fn(x, w) for w in ws]
    return time_graph(calls, reps=10)


def graph_batch(m: int) -> int:
    """The decode graph size a batch of ``m`` pads to (the engine's ladder, before any route)."""
    return next(s for s in batch_size_ladder(DECODE_MAX + 16) if s >= m)


def estimate_mixed(per_m: dict[int, float]) -> float:
    """Seconds of one layer's GEMMs x 32 layers over `mixed`'s steps (decode batches padded to their graph's),
    linear between the measured M."""
    ms = sorted(per_m)

    def at(m: int) -> float:
        lo = max(x for x in ms if x <= m) if m >= ms[0] else ms[0]
        hi = min(x for x in ms if x >= m) if m <= ms[-1] else ms[-1]
        if lo == hi:
            return per_m[lo]
        return per_m[lo] + (per_m[hi] - per_m[lo]) * (m - lo) / (hi - lo)

    total = PREFILL_STEPS * at(PREFILL_M) + sum(at(graph_batch(m)) for m in range(1, DECODE_MAX + 1))
    return 32 * total


def run(m_values: list[int], backends: list[str], autotune: list[int]) -> dict[str, Any]:
    rate = measure_matmul_tflops()  # the suite's ceiling, so the ratios compare with its MFU
    res: dict[str, Any] = {"matmul_tflops": round(rate, 1), "rows": []}
    print(json.dumps({"matmul_tflops": res["matmul_tflops"]}), flush=True)
    weights = {name: layer_weights(n, k) for name, n, k in LAYERS}
    per_backend: dict[str, dict[int, float]] = {b: {} for b in backends}
    for backend in backends:
        torch.backends.cuda.preferred_blas_library(backend)
        for m in m_values:
            row: dict[str, Any] = {"backend": backend, "m": m}
            layer_s = 0.0
            for name, n, k in LAYERS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                sec = time_layer(F.linear, x, weights[name])
                layer_s += sec
                row[name] = {"us": round(sec * 1e6, 2), "of_rate": round(2 * m * n * k / sec / 1e12 / rate, 3)}
            flops = sum(2 * m * n * k for _, n, k in LAYERS)
            row["layer_us"] = round(layer_s * 1e6, 2)
            row["layer_of_rate"] = round(flops / layer_s / 1e12 / rate, 3)
            per_backend[backend][m] = layer_s
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    ideal = estimate_mixed({m: sum(2 * m * n * k for _, n, k in LAYERS) / (rate * 1e12) for m in m_values})
    res["mixed_estimate_s"] = {b: round(estimate_mixed(v), 3) for b, v in per_backend.items() if len(v) > 1}
    res["mixed_estimate_s"]["at_matmul_rate"] = round(ideal, 3)
    print(json.dumps({"mixed_estimate_s": res["mixed_estimate_s"]}), flush=True)
    for m in autotune:
        res["rows"].append(_autotuned(m, weights, rate))
    return res


def _autotuned(m: int, weights: dict[str, list[torch.Tensor]], rate: float) -> dict[str, Any]:
    """Inductor's max-autotune pick for each layer at M = m (compiled once per shape, then timed as above)."""
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    row: dict[str, Any] = {"backend": "inductor", "m": m}
    for name, n, k in LAYERS:
        fn = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fn(x, weights[name][0])
        sec = time_layer(fn, x, weights[name])
        row[name] = {"us": round(sec * 1e6, 2), "of_rate": round(2 * m * n * k / sec / 1e12 / rate, 3)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=list(M_VALUES))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--autotune", type=int, nargs="*", default=[], help="M values for Inductor's max-autotune")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_probe needs a CUDA device", file=sys.stderr)
        return 2
    res = run(args.m, args.backends, args.autotune)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
