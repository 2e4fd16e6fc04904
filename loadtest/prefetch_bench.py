"""What an L2 prefetch a kernel ahead buys a batch-1 GEMV (``kernels.l2_prefetch``):
``python -m loadtest.prefetch_bench [--fillers-us 0 5 10] [--out FILE]`` (GPU).

For each 8B layer shape, int4 (group 128, the engine's GEMV) and bf16 (cuBLAS ``F.linear``), M = 1, in CUDA
graphs cycling weight copies past the L2. Each call is a filler kernel (``torch.cuda._sleep``: one thread
spinning, which is what the norms and attention between two projections look like to the HBM: idle) then the
GEMM. Four ways to run it:

- ``none``: no prefetch;
- ``inline``: a prefetch on the same stream before the filler;
- ``side``: a prefetch on a side stream forked there;
- ``hot``: one weight copy every time, so the GEMM reads it from the L2 (what a perfect prefetch could give).

Printed: an empty kernel's cost in a graph, then the GEMM's microseconds in each way (the call's time less the
filler's alone).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels.int4_gemm import int4_gemm
from kernels.l2_prefetch import prefetch_l2
from loadtest.int4_gemm_sweep import LAYER_SHAPES_8B, ROTATE_BYTES, random_int4
from loadtest.kernel_bench_common import time_graph

GROUP_SIZE = 128


def _cycles_per_us() -> float:
    """Clock of ``torch.cuda._sleep``'s spin, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1_000_000 / (start.elapsed_time(end) * 1e3)


def _calls(
    gemm: Callable[[Any], object], weights: list[Any], tensors: Callable[[Any], list[torch.Tensor]], mode: str,
    filler: Callable[[], None], side: torch.cuda.Stream,
) -> list[Callable[[], object]]:  # fmt: skip
    def one(w: Any) -> Callable[[], object]:
        def call() -> object:
            if mode == "side":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for t in tensors(w):
                        prefetch_l2(t)
            elif mode == "inline":
                for t in tensors(w):
                    prefetch_l2(t)
            filler()
            out = gemm(w)
            if mode == "side":
                torch.cuda.current_stream().wait_stream(side)
            return out

        return call

    return [one(w) for w in weights]


def bench_shape(name: str, n: int, k: int, fillers_us: list[float], reps: int) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    int4_copies = max(2, min(32, ROTATE_BYTES // (n * k // 2)))
    dense_copies = max(2, min(16, ROTATE_BYTES // (2 * n * k)))
    kinds: dict[str, tuple[Callable[[Any], object], list[Any], Callable[[Any], list[torch.Tensor]]]] = {
        "int4": (
            lambda w: int4_gemm(x, w["qweight"], w["scales"], w["zeros"], GROUP_SIZE),
            [random_int4(n, k, torch.bfloat16, dev, seed=i) for i in range(int4_copies)],
            lambda w: [w["qweight"], w["scales"], w["zeros"]],
        ),
        "bf16": (
            lambda w: torch.nn.functional.linear(x, w),
            [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(dense_copies)],
            lambda w: [w],
        ),
    }
    side = torch.cuda.Stream()
    per_us = _cycles_per_us()
    rows = []
    for f_us in fillers_us:
        cycles = int(f_us * per_us)

        def filler(cycles: int = cycles) -> None:
            if cycles:
                torch.cuda._sleep(cycles)

        filler_s = time_graph([filler] * 16, reps) if cycles else 0.0
        for kind, (gemm, weights, tensors) in kinds.items():
            row: dict[str, Any] = {"shape": name, "kind": kind, "filler_us": round(filler_s * 1e6, 2)}
            for mode in ("none", "inline", "side", "hot"):
                # hot: one weight copy every call, so it stays in the L2 (what a perfect prefetch would give)
                ws = weights[:1] * len(weights) if mode == "hot" else weights
                t = time_graph(_calls(gemm, ws, tensors, mode, filler, side), reps)
                row[mode] = round((t - filler_s) * 1e6, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.prefetch_bench", description=__doc__)
    parser.add_argument("--fillers-us", type=float, nargs="+", default=[0.0, 5.0, 10.0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefetch_bench needs CUDA", flush=True)
        return 2
    empty = time_graph([lambda: torch.cuda._sleep(0)] * 64, args.reps)
    print(f"an empty one-thread kernel in a CUDA graph, back to back: {empty * 1e6:.2f} us", flush=True)
    rows = []
    for name, n, k in LAYER_SHAPES_8B:
        rows += bench_shape(name, n, k, args.fillers_us, args.reps)
        torch.cuda.empty_cache()
    print("shape kind filler_us: none / inline / side / hot (GEMM us)")
    for r in rows:
        print(f"{r['shape']} {r['kind']} {r['filler_us']}: {r['none']} / {r['inline']} / {r['side']} / {r['hot']}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
