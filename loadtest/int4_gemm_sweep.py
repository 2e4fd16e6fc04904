"""The fused-GEMM half of ``loadtest.int4_bench``: the Triton int4 GEMM's variants (``kernels.int4_gemm``
launch choices, the GEMVs' among them), each checked against the torch reference and timed in CUDA graphs
cycling through weight copies that overflow the L2; and the GEMV table: per M = 1..16, per variant and shape,
µs, GB/s (packed weights + scales + zeros + activations + output, once) and the fraction of the copy
bandwidth measured in the same run, plus the best variant per shape. The table decides
``kernels.int4_plan``'s small-M defaults: its rows are named after the variants below.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kernels.int4_config import Int4GemmConfig, Int4Launch
from kernels.int4_dequant import DequantScratch, pack_int4
from kernels.int4_gemm import int4_gemm
from kernels.int4_plan import pick_config
from loadtest.int4_model import GROUP_SIZE
from loadtest.int4_stats import DEQUANT, FUSED
from loadtest.kernel_bench_common import device_timer as timer
from loadtest.kernel_bench_common import rel_err

ROTATE_BYTES = 512 << 20  # weight copies cycled per graph: ~10x the H200's L2
# Llama-3-8B: (name, N, K) of each projection, fused as the engine runs them
LAYER_SHAPES_8B = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LAYER_SHAPES_TINY = (("qkv", 256, 128), ("down", 128, 256))
DECODE, PREFILL = (1, 16), (1024, 1 << 30)
GEMV_TABLE_M = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Variant:
    """``Int4GemmConfig`` fields, run at ``m_range[0] <= M <= m_range[1]``."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    m_range: tuple[int, int] = (1, 1 << 30)


SUB = {"kernel": "gemv", "subnormal": True}
# the defaults (kernels.int4_plan.pick_config) and the alternatives that came close in the H200 run at 7f8955d
# or were the defaults before it; where one is the default's launch at an M it is timed once, as an alias.
# (The "cols ..." rows went with kernels.int4_gemv_cols in Session 28: none beat the GEMV at M = 1-2.)
VARIANTS = [
    Variant(FUSED),  # int4_gemm's default launch at M
    Variant("gemv", {"kernel": "gemv"}, DECODE),  # on wide layers at M = 1: the "gemv sub w1 pps16" tile
    Variant("gemv counter", {"kernel": "gemv", "split_reduce": "counter"}, (1, 8)),
    Variant("gemv atomic", {"kernel": "gemv", "split_reduce": "atomic"}, (1, 8)),
    Variant("gemv bn128", {"kernel": "gemv", "block_n": 128}, (1, 8)),
    Variant("gemv bk128", {"kernel": "gemv", "block_k": 128}, (1, 1)),
    Variant("gemv split32", {"kernel": "gemv", "split_k": 32}, (1, 4)),
    Variant("gemv stages3", {"kernel": "gemv", "num_stages": 3}, (1, 2)),
    Variant("gemv pps2", {"kernel": "gemv", "programs_per_sm": 2}, (1, 4)),
    Variant("gemv exact", {"kernel": "gemv", "factored": False}, (1, 1)),  # what g_idx checkpoints run
    # codes as subnormals (kernels.int4_gemv.subnormal); at M = 1 on wide layers 8 columns per thread and 16 programs
    # per SM (int4_plan.GEMV_WIDE_TILE). Removed after the H200 run at 5da38c4, where they won no shape: w1 with 4
    # and 8 programs per SM, bn1024 with 2 and 8, bn2048 with 8 warps, w1 pps8 with mantissa codes
    Variant("gemv sub", {**SUB}, DECODE),
    Variant("gemv sub w1 pps16", {**SUB, "num_warps": 1, "programs_per_sm": 16}, (1, 1)),
    Variant(
        "gemv mantissa w1 pps16", {"kernel": "gemv", "subnormal": False, "num_warps": 1, "programs_per_sm": 16}, (1, 1)
    ),
    Variant("gemv sub bn1024", {**SUB, "block_n": 1024}, (1, 1)),  # second on gate_up (25.2 us)
    Variant(
        "gemv narrow",
        {"kernel": "gemv", "subnormal": False, "block_n": 256, "num_warps": 4, "programs_per_sm": 4},
        (1, 1),
    ),
    # kernels.int4_gemv_mma (Gluon, tensor cores): its default launch at every M up to 8, then one field changed each
    # (H200, Session 23; removed: 512 columns, 8 programs per SM, vector loads, the next tile loaded ahead)
    Variant("mma", {"kernel": "mma"}, (1, 256)),  # above 8 rows: block_m up to 64, dequantized weights from 16
    Variant("mma factored", {"kernel": "mma", "factored": True}, (16, 64)),
    Variant("mma bm32", {"kernel": "mma", "block_m": 32}, (33, 256)),
    Variant("mma pps8", {"kernel": "mma", "programs_per_sm": 8}, (16, 256)),
    Variant("mma pps1", {"kernel": "mma", "programs_per_sm": 1}, (1, 8)),
    Variant("mma pps2", {"kernel": "mma", "programs_per_sm": 2}, (1, 256)),
    Variant("mma pps4", {"kernel": "mma", "programs_per_sm": 4}, (16, 32)),
    Variant("mma bn256", {"kernel": "mma", "block_n": 256}, (1, 32)),  # x's tile read by half as many programs
    Variant("mma w8", {"kernel": "mma", "num_warps": 8}, (1, 32)),
    Variant("mma bn256 w8", {"kernel": "mma", "block_n": 256, "num_warps": 8}, (16, 32)),
    Variant("mma bm16", {"kernel": "mma", "block_m": 16}, (17, 64)),  # 16-row tiles
    Variant("mma bk128", {"kernel": "mma", "block_k": 128}, (17, 64)),
    # kernels.int4_gemm_wgmma (Gluon, Hopper's warpgroup MMA): its launch and one field changed each
    Variant("wgmma", {"kernel": "wgmma"}, (16, 512)),
    Variant("wgmma bm32", {"kernel": "wgmma", "block_m": 32}, (33, 512)),
    Variant("wgmma bm128", {"kernel": "wgmma", "block_m": 128}, (33, 512)),
    Variant("wgmma bk64", {"kernel": "wgmma", "block_k": 64}, (16, 512)),
    Variant("wgmma bn128", {"kernel": "wgmma", "block_n": 128}, (16, 512)),
    Variant("wgmma pps4", {"kernel": "wgmma", "programs_per_sm": 4}, (16, 512)),
    # two warpgroups a program sharing x's tile (half the x traffic a weight). The pipelined K loops ("prefetch",
    # "async") lost in every row at 64-512 (H200, Session 33) and were removed with their rows
    Variant("wgmma w8", {"kernel": "wgmma", "block_n": 128, "num_warps": 8}, (16, 512)),
    Variant("dot", {"kernel": "dot"}),
    Variant("dot counter", {"kernel": "dot", "split_reduce": "counter"}, (8, 256)),
    Variant("dot atomic", {"kernel": "dot", "split_reduce": "atomic"}, (8, 256)),
    Variant("dot rows", {"kernel": "dot", "unpack_in_registers": False}, (8, 1 << 30)),  # no unpack_in_registers
    Variant("dot unpack", {"kernel": "dot", "unpack_in_registers": True}, (8, 1 << 30)),
    # the tl.dot tile at M = 5..64 after its loop lost its per-weight waste (Session 14): the rows that won a shape
    # at M = 8 or 16 against the old 64-column default; split 2 and 16, 32 columns, 8 warps, 2 and 6 stages and
    # the scale applied per tile to the sums won none and were removed
    Variant("dot bn64", {"kernel": "dot", "block_n": 64}, (8, 64)),  # the default before
    Variant("dot split8", {"kernel": "dot", "split_k": 8}, (8, 64)),  # gate_up at M = 8 and 16
    Variant("dot bk128", {"kernel": "dot", "block_k": 128}, (8, 16)),  # qkv at M = 8
    Variant("dot w2", {"kernel": "dot", "num_warps": 2}, (8, 16)),  # o and down at M = 8
    # Removed after the H200 run of 2026-12-04 (M = 96, 128, 256): one M tile of 128 or 256 rows, so each weight is
    # dequantized once, with or without unpacking, or 64 columns: 1.08-2.13x the dequantization + cuBLAS path
    # (the 128 x 64 tile won only down_proj at M = 96 and 128: 73.4 and 77.4 us against 79.6 and 80.7)
    Variant("dot stages4", {"kernel": "dot", "num_stages": 4}, PREFILL),
    Variant("dot bm128", {"kernel": "dot", "block_m": 128}, PREFILL),
]

# INT4_SWEEP_ONLY="mma,gemv sub": only the default launch ("fused") and the variants whose names start with one of
# these (a short device call that times one family against the default)
ONLY = tuple(p for p in os.environ.get("INT4_SWEEP_ONLY", "").split(",") if p)


def variants_at(m: int, n: int, k: int, num_sms: int) -> tuple[dict[str, Int4GemmConfig], dict[str, str]]:
    """The variants that run at this shape, one per distinct launch ("fused" first), and the aliases
    dropped (name -> the variant with the same launch)."""
    launches: dict[Int4Launch, str] = {}
    configs: dict[str, Int4GemmConfig] = {}
    aliases = {}
    for v in VARIANTS:
        if not v.m_range[0] <= m <= v.m_range[1] or (ONLY and v.name != FUSED and not v.name.startswith(ONLY)):
            continue
        cfg = Int4GemmConfig(**v.fields)
        launch = pick_config(m, n, k, GROUP_SIZE, num_sms, cfg)
        if launch in launches:
            aliases[v.name] = launches[launch]
        else:
            launches[launch] = v.name
            configs[v.name] = cfg
    return configs, aliases


def random_int4(n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = k // GROUP_SIZE
    codes = torch.randint(0, 16, (k, n), generator=gen, device=device)
    return {
        "qweight": pack_int4(codes),
        "scales": (0.002 + 0.004 * torch.rand(groups, n, generator=gen, device=device)).to(dtype),
        "zeros": torch.randint(6, 10, (groups, n), generator=gen, device=device).to(torch.uint8),
    }


def int4_bytes(m: int, n: int, k: int, elem: int = 2) -> int:
    groups = k // GROUP_SIZE
    return n * k // 2 + groups * n * (elem + 1) + m * k * elem + m * n * elem


@dataclass
class ShapeData:
    """One layer shape's weights on the device: int4 copies and dense bf16 copies (GPU only) to cycle; the
    dequantization's buffers (one, as in the engine: every weight copy is dequantized into it)."""

    name: str
    n: int
    k: int
    weights: list[dict[str, torch.Tensor]]
    dense: list[torch.Tensor]
    scratch: DequantScratch
    kn_buffer: torch.Tensor  # [K, N]


def make_shape(name: str, n: int, k: int, dtype: torch.dtype, device: torch.device) -> ShapeData:
    on_gpu = device.type == "cuda"
    copies = max(1, min(16, ROTATE_BYTES // (n * k // 2))) if on_gpu else 1
    weights = [random_int4(n, k, dtype, device, seed=i) for i in range(copies)]
    dense_copies = max(1, min(8, ROTATE_BYTES // (2 * n * k))) if on_gpu else 0
    dense = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(dense_copies)]
    scratch = DequantScratch()
    scratch.weight(n, k, dtype, device)  # allocated before any capture
    return ShapeData(name, n, k, weights, dense, scratch, torch.empty(k, n, dtype=dtype, device=device))


def check_and_time(
    row: dict[str, Any],
    name: str,
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    ref: torch.Tensor,
    weights: list[dict[str, torch.Tensor]],
    reps: int,
) -> None:
    """``fn(x, w)`` checked against the reference (into ``row["err"]``, ``row["wrong"]``), then timed on
    the GPU cycling through ``weights`` (``row["us"]``); a variant that fails to launch is skipped."""
    tol = 1e-4 if x.dtype == torch.float32 else 1e-2
    try:
        err = rel_err(fn(x, weights[0]), ref)  # compiles
        row["err"][name] = float(f"{err:.1e}")
        if err > tol:
            row.setdefault("wrong", []).append(name)
        elif x.is_cuda:
            row["us"][name] = round(1e6 * timer(x.device)([partial(fn, x, w) for w in weights], reps), 2)
    except Exception as exc:  # a variant past the shared-memory limit (OutOfResources): skip it
        if name in (FUSED, DEQUANT):
            raise
        row.setdefault("skipped", {})[name] = f"{type(exc).__name__}: {str(exc)[:80]}"


def _fused(cfg: Int4GemmConfig, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return int4_gemm(x, **w, group_size=GROUP_SIZE, config=cfg)


def time_fused_variants(row: dict[str, Any], shape: ShapeData, x: torch.Tensor, ref: torch.Tensor, reps: int) -> None:
    """Every fused variant that runs at ``row``'s M, checked and timed into ``row`` (aliases listed)."""
    m = x.shape[0]
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    configs, row["aliases"] = variants_at(m, shape.n, shape.k, num_sms)
    weights = shape.weights if m < PREFILL[0] else shape.weights[:2]  # prefill is compute bound: no L2 games
    for name, cfg in configs.items():
        check_and_time(row, name, partial(_fused, cfg), x, ref, weights, reps)


def gemv_table(rows: list[dict[str, Any]], copy_tb_s: float | None) -> list[str]:
    """Per M of GEMV_TABLE_M: one line per fused variant (fastest first by the geometric mean over the
    shapes of time / the shape's best fused time), cells "µs GB/s fraction-of-copy" per shape; then the
    best fused variant per shape and cuBLAS."""
    lines = [f"GEMV table: us  GB/s  fraction of the copy bandwidth ({copy_tb_s or math.nan:.2f} TB/s, same run)"]
    fused_names = {v.name for v in VARIANTS}
    for m in GEMV_TABLE_M:
        cases = [r for r in rows if r["m"] == m and "cublas_us" in r]
        if not cases:
            continue
        lines.append(
            f"M={m:<3d} {'variant':20s} | "
            + " | ".join(f"{r['layer'] + ' ' + str(r['n']) + 'x' + str(r['k']):23s}" for r in cases)
        )
        best = {r["layer"]: min((t for n, t in r["us"].items() if n in fused_names), default=math.nan) for r in cases}

        def cell(r: dict[str, Any], t: float | None, bf16: bool = False) -> str:
            if t is None:
                return f"{'-':>7s}{'':16s}"
            n, k = r["n"], r["k"]
            gb_s = (2 * (n * k + r["m"] * (n + k)) if bf16 else int4_bytes(r["m"], n, k)) / 1e3 / t
            return f"{t:7.1f} {gb_s:6.0f} {gb_s / 1e3 / (copy_tb_s or math.nan):5.2f}   "

        names = [n for n in dict.fromkeys(n for r in cases for n in r["us"]) if n in fused_names]
        ratio = {n: math.prod(r["us"][n] / best[r["layer"]] for r in cases if n in r["us"]) for n in names}
        count = {n: sum(n in r["us"] for r in cases) for n in names}
        for n in sorted(names, key=lambda n: (-count[n], ratio[n] ** (1 / count[n]))):
            lines.append(f"      {n:20s} | " + " | ".join(cell(r, r["us"].get(n)) for r in cases))
        winners = [min((n for n in r["us"] if n in fused_names), key=r["us"].__getitem__) for r in cases]
        lines.append(f"      {'best (variant)':20s} | " + " | ".join(f"{w:23s}" for w in winners))
        lines.append(f"      {'best':20s} | " + " | ".join(cell(r, best[r["layer"]]) for r in cases))
        lines.append(f"      {'cuBLAS (bf16 bytes)':20s} | " + " | ".join(cell(r, r["cublas_us"], True) for r in cases))
        if all("copy_us" in r for r in cases):  # a copy moving the same bytes: the practical floor of a kernel
            lines.append(f"      {'copy (same bytes)':20s} | " + " | ".join(cell(r, r["copy_us"]) for r in cases))
            lines.append(
                f"      {'best / copy':20s} | " + " | ".join(f"{best[r['layer']] / r['copy_us']:<23.2f}" for r in cases)
            )
    return lines
