"""What leaving a batch-1 int4 GEMV's split-K sums to the RMSNorm after it buys (``kernels.int4_gemm.int4_gemv_sums``).

The batch-1 step's o_proj and down_proj GEMVs each end with a reduction pass: their 32 K splits add into an fp32
accumulator, count themselves in, and the last one rounds the sums, writes the output and zeroes the accumulator.
Only an RMSNorm reads that output. With ``sums`` the GEMV stops after its adds, and the norm rounds and zeroes.

Times, on the GPU, 32 pairs (GEMV -> RMSNorm with the residual add) at the 8B shapes, each pair with its own int4
weights (so they stream from HBM, as in a decode step), captured back to back in one CUDA graph, the kernels launched
as the engine launches them (PDL on sm_90): ``reduce`` (the GEMV's own reduction, then the norm) against ``sums``,
alternating. First checks that both give the same output. ``python -m loadtest.sums_bench [--out F]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kernels.int4_gemm import int4_gemm, int4_gemm_gated, int4_gemv_sums
from kernels.norm import rms_norm
from loadtest.kernel_bench_common import rel_err, time_graph

SHAPES = {"o": (4096, 4096, False), "down": (4096, 14336, True)}  # n, k, gated (silu * mul on the load)
GROUP = 128
PAIRS = 32


def _weights(k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen).cuda()
    scales = (0.002 + 0.01 * torch.rand(k // GROUP, n, generator=gen)).to(torch.bfloat16).cuda()
    zeros = torch.randint(0, 16, (k // GROUP, n), dtype=torch.uint8, generator=gen).cuda()
    return qweight, scales, zeros


def _pairs(shape: str, sums_mode: bool, gen: torch.Generator) -> tuple[list, torch.Tensor]:  # type: ignore[type-arg]
    """``PAIRS`` calls GEMV -> norm on their own weights, and the first call's output buffer holder."""
    n, k, gated = SHAPES[shape]
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16).cuda()
    residual = torch.randn(1, n, generator=gen).to(torch.bfloat16).cuda()
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16).cuda()
    sums = torch.zeros(1, n, dtype=torch.float32, device="cuda")
    gemm = int4_gemm_gated if gated else int4_gemm
    calls = []
    for _ in range(PAIRS):
        qw, sc, zr = _weights(k, n, gen)
        if sums_mode:

            def call(qw=qw, sc=sc, zr=zr):  # type: ignore[no-untyped-def]
                int4_gemv_sums(x, qw, sc, zr, GROUP, sums, gated=gated)
                return rms_norm(sums, weight, 1e-5, residual, sums=True)[0]
        else:

            def call(qw=qw, sc=sc, zr=zr):  # type: ignore[no-untyped-def]
                return rms_norm(gemm(x, qw, sc, zr, GROUP), weight, 1e-5, residual)[0]

        calls.append(call)
    return calls, sums


def run(reps: int, rounds: int) -> dict[str, object]:
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "pairs": PAIRS}
    for shape in SHAPES:
        reduce_calls, _ = _pairs(shape, False, torch.Generator().manual_seed(0))
        sums_calls, sums = _pairs(shape, True, torch.Generator().manual_seed(0))
        err = rel_err(sums_calls[0]().float(), reduce_calls[0]().float())
        row: dict[str, object] = {"rel_err": err, "sums_left_zero": not bool(sums.any())}
        for r in range(rounds):
            for mode, calls in (("reduce", reduce_calls), ("sums", sums_calls)):
                row[f"{mode}_us_{r}"] = round(time_graph(calls, reps) * 1e6, 3)
        results[shape] = row
        print(json.dumps({shape: row}), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sums_bench", description=__doc__)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sums_bench needs CUDA", file=sys.stderr)
        return 2
    results = run(args.reps, args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
