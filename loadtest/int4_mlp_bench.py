"""The int4 MLP at batch 1 in one launch (``kernels.int4_mlp``) against the engine's two GEMVs (gate_up, then the
gated down projection): ``python -m loadtest.int4_mlp_bench [--variants NAME ...] [--out FILE]`` (GPU).

Llama-3-8B shape (hidden 4096, intermediate 14336), group 128, bf16, M = 1, CUDA graphs cycling weight copies
past the L2. Each variant changes fields of ``kernels.int4_mlp.DEFAULT_TILE``; every one is checked against the
two GEMVs first (relative error of its output). Printed: microseconds per MLP, the copy of the same bytes in the
same process, and the fraction of that copy's speed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kernels.int4_gemm import int4_gemm, int4_gemm_gated
from kernels.int4_mlp import DEFAULT_TILE, Int4Weights, MlpTile, int4_mlp
from loadtest.int4_bench import same_traffic_copy_s
from loadtest.int4_gemm_sweep import ROTATE_BYTES, random_int4
from loadtest.kernel_bench_common import time_graph

HIDDEN, INTER, GROUP = 4096, 14336, 128
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "i16": {"block_i": 16},
    "i16 w2": {"block_i": 16, "num_warps": 2},
    "i16 w1": {"block_i": 16, "num_warps": 1},
    "i64": {"block_i": 64},
    "i64 w8": {"block_i": 64, "num_warps": 8},
    "i8 w1": {"block_i": 8, "num_warps": 1},
    "k32": {"block_k": 32},
    "k128": {"block_k": 128},
    "n256": {"block_n": 256},
    "n1024": {"block_n": 1024},
    "s2": {"num_stages": 2},
    "s4": {"num_stages": 4},
    "mantissa": {"subnormal": False},
    "w2": {"num_warps": 2},
    "w8": {"num_warps": 8},
    "i16 k128": {"block_i": 16, "block_k": 128},
    "i16 k128 w2": {"block_i": 16, "block_k": 128, "num_warps": 2},
    "i32 k128 w8": {"block_k": 128, "num_warps": 8},
}


def _layer(n: int, k: int, seed: int) -> Int4Weights:
    w = random_int4(n, k, torch.bfloat16, torch.device("cuda"), seed=seed)
    return Int4Weights(w["qweight"], w["scales"], w["zeros"], GROUP)


def _two_gemvs(x: torch.Tensor, gu: Int4Weights, dn: Int4Weights) -> torch.Tensor:
    x2 = int4_gemm(x, gu.qweight, gu.scales, gu.zeros, GROUP)
    return int4_gemm_gated(x2, dn.qweight, dn.scales, dn.zeros, GROUP)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.int4_mlp_bench", description=__doc__)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("int4_mlp_bench needs CUDA", flush=True)
        return 2
    first = (_layer(2 * INTER, HIDDEN, 0), _layer(HIDDEN, INTER, 1))
    mlp_bytes = sum(t.nbytes for w in first for t in (w.qweight, w.scales, w.zeros))
    copies = max(2, min(16, ROTATE_BYTES // mlp_bytes))
    layers = [first] + [(_layer(2 * INTER, HIDDEN, 2 * i), _layer(HIDDEN, INTER, 2 * i + 1)) for i in range(1, copies)]
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    ref = _two_gemvs(x, *layers[0])
    rows: list[dict[str, Any]] = []
    copy_us = same_traffic_copy_s(mlp_bytes, args.reps) * 1e6
    two_us = time_graph([partial(_two_gemvs, x, gu, dn) for gu, dn in layers], args.reps) * 1e6
    rows.append({"variant": "two GEMVs (engine)", "us": round(two_us, 2), "rel_err": 0.0})
    for name in args.variants:
        tile: MlpTile = replace(DEFAULT_TILE, **VARIANTS[name])
        try:
            err = _rel(int4_mlp(x, *layers[0], tile), ref)
            us = time_graph([partial(int4_mlp, x, gu, dn, tile) for gu, dn in layers], args.reps) * 1e6
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile (registers) is a row, not a stop
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        rows.append({"variant": name, "us": round(us, 2), "rel_err": round(err, 5), "tile": tile.__dict__})
        print(json.dumps(rows[-1]), flush=True)
    print(f"int4 MLP at M = 1 (8B, {mlp_bytes / 1e6:.1f} MB): copy of the same bytes {copy_us:.2f} us")
    for r in rows:
        if "us" in r:
            print(f"{r['variant']:>22}: {r['us']:7.2f} us  {copy_us / r['us']:.2f} of the copy  err {r['rel_err']}")
        else:
            print(f"{r['variant']:>22}: {r['error']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_us": copy_us, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
