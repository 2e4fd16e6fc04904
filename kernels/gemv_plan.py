"""The dense GEMV's launch plan (``kernels.gemv``): from (M, N, K, SM count) alone, whether the linear layers
use the GEMV or cuBLAS, and with which kernel, tiles and split-K. The constants are the H200 sweep's
(``python -m loadtest.gemv_bench``); each comment says which measurement set it. A module of its own so the
kernels stay readable; the layers' switch constants live here (tests monkeypatch them here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kernels._triton import next_pow2

Kernel = Literal["fma", "dot"]
SplitReduce = Literal["counter", "atomic", "two_pass"]
GEMV_LIMIT_M = 16  # the fma kernel holds all rows in registers, the dot kernel pads them to 16

# ---- the plan: constants decided by the H200 sweep ``python -m loadtest.gemv_bench`` ----

# THE switch: the dense layers run the GEMV for M <= GEMV_MAX_M rows, cuBLAS above (0: cuBLAS everywhere).
# H200 sweeps (loadtest.gemv_bench, four runs, 2026-12-01), the default launch against cuBLAS, alone / behind a
# small kernel that writes x (as in a decode step): M = 1 qkv 14.5-14.8 vs 15.8-16.5 / 16.3-17.2 vs 18.4-18.8
# us, o 10.4-10.6 vs 13.5-14.2 / 11.8-12.7 vs 14.8-15.3, down 29.7-31.5 vs 32.6-33.7 / 32.0-32.9 vs 34.4-35.2;
# M = 2-8 o 11.7-12.0 vs 13.3-14.0, down 31.4-32.7 vs 32.7-34.1, qkv within +-1-4 %. The 8B-shape batch-1 TPOT
# (loadtest.throughput latency, dummy weights, CUDA graphs), same device call: 4.977 ms with cuBLAS, 4.709
# with these two constants (an earlier call: 4.985 -> 4.712).
GEMV_MAX_M = 8
# ... for weights of at most this many elements: gate_up (28672 x 4096 = 117 M) went either way by 2-8 % in
# the sweeps (cuBLAS streams it at ~92 % of the copy bandwidth) and the TPOT with it on the GEMV too was
# 4.722 ms (against 4.709 without), so it keeps cuBLAS; down (4096 x 14336 = 58.7 M) gains every time.
GEMV_MAX_WEIGHT_ELEMS = 64 << 20
# Programmatic dependent launch (sweep rows "fma pdl" / "dot pdl"): within 1-3 % of the plain launch either
# way on the H200, behind a small kernel slightly slower (qkv 16.5 vs 16.3 us at M = 1), so off. The variant that also prefetched the first
# 2048 weights of each row into L2 before waiting lost 5-25 % and was deleted.
USE_PDL = False
# Split-K (sweep rows "dot split1/2/4"): none when N alone gives SPLIT_MIN_FILL programs per SM, else doubling
# until there is one per SM. Three H200 runs, dot kernel (64 columns a tile) at M = 2-8: qkv (96 tiles) was
# fastest unsplit (15.5-16.3 us against 15.7-17.2 split 2 and 17.1-18.4 split 4); o and down (64 tiles) with
# 4 splits (o 11.6-12.0 us against 11.4-12.2 split 2 and 12.8-13.4 unsplit; down 31.3-32.0 against 38.8-39.5
# unsplit). The fma kernel at M = 1 (1024+ tiles) lost 10-30 % with any split.
SPLIT_MIN_FILL = 0.7
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemvConfig:
    """Knobs a caller (the benchmark, the tests) may force; None leaves the plan's default."""

    kernel: Kernel | None = None
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None  # wanted splits; fewer when K has fewer block_k tiles
    split_reduce: SplitReduce | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    pdl: bool | None = None  # programmatic dependent launch (CUDA only), see GemvPlan


@dataclass(frozen=True)
class GemvPlan:
    """One launch: ``use_gemv`` False means the linear layers call cuBLAS (the knobs still say what
    ``gemv`` itself would launch). ``split_k`` is the number of K ranges of ``k_per_split`` elements.
    ``pdl``: launched with programmatic dependent launch, so the programs may start while the kernel before
    finishes; they wait for it (``griddepcontrol.wait``) before any load or store."""

    use_gemv: bool
    kernel: Kernel
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    split_reduce: SplitReduce
    num_warps: int
    num_stages: int
    pdl: bool = False


# (block_n, block_k, num_warps, num_stages) by block_m: the fma kernel's accumulator holds
# block_m * block_n * block_k / (32 * num_warps) fp32 registers per thread. H200 sweeps (loadtest.gemv_bench,
# geometric mean over the 8B shapes of time / the best variant's), M = 1: bn4 bk512 w2 1.01 (bn8 bk512 w2
# 1.01, bn4 bk512 w4 1.05, cuBLAS 1.11). Past M = 1 the [M, bn, bk] products cost layout shuffles: at M = 2
# the best fma 1.02-1.04 against dot 1.02, fma 1.23 (M = 4) and 1.96 (M = 8).
_FMA_TILES = {1: (4, 512, 2, 3), 2: (8, 256, 2, 3), 4: (8, 256, 4, 3), 8: (4, 256, 4, 3), 16: (2, 256, 4, 3)}
# block_n, block_k, num_warps, num_stages: 1.02-1.04 at M = 2-8 (s5 1.02-1.04, s3 1.04, bn128 bk128 s3 1.07)
_DOT_TILE = (64, 128, 4, 4)
_DEFAULT_KERNEL_MAX_M = 1  # fma up to here, dot above (M = 2: the best of each kernel within 1 %)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _fill_split(num_tiles: int, num_k_tiles: int, sms: int) -> int:
    """1 when the N tiles fill SPLIT_MIN_FILL of the SMs, else the smallest power of two giving every SM a
    program (within K's tiles)."""
    split = 1
    if num_tiles >= SPLIT_MIN_FILL * sms:
        return split
    while num_tiles * split < sms and split * 2 <= min(MAX_SPLIT_K, num_k_tiles):
        split *= 2
    return split


def plan_gemv(m: int, n: int, k: int, sms: int, config: GemvConfig | None = None) -> GemvPlan:
    """A pure function of the shape and the SM count (no device sync: a CUDA graph keeps the plan it was
    captured with). A ``config`` forces its knobs (and the GEMV); None fields keep the defaults above."""
    if not 1 <= m <= GEMV_LIMIT_M or n < 1 or k < 1:
        raise ValueError(f"gemv needs 1 <= M <= {GEMV_LIMIT_M} and N, K >= 1, got M={m} N={n} K={k}")
    user = config or GemvConfig()
    kernel: Kernel = user.kernel or ("fma" if m <= _DEFAULT_KERNEL_MAX_M else "dot")
    if kernel == "dot":
        block_m = max(16, next_pow2(m))
        bn, bk, warps, stages = _DOT_TILE
    elif kernel == "fma":
        block_m = next_pow2(m)
        bn, bk, warps, stages = _FMA_TILES[block_m]
    else:
        raise ValueError(f"gemv kernel must be 'fma' or 'dot', got {kernel!r}")
    bn, bk = user.block_n or bn, user.block_k or bk
    warps, stages = user.num_warps or warps, user.num_stages or stages
    min_tile = 16 if kernel == "dot" else 1
    if not (_is_pow2(bn) and _is_pow2(bk) and bn >= min_tile and bk >= max(min_tile, 8)):
        raise ValueError(f"gemv {kernel}: block_n and block_k must be powers of two >= {min_tile} (block_k >= 8)")
    if not _is_pow2(warps) or stages < 1 or (user.split_k is not None and user.split_k < 1):
        raise ValueError(f"gemv: num_warps must be a power of two, num_stages and split_k >= 1, got {user}")
    reduce = user.split_reduce or "counter"
    if reduce not in ("counter", "atomic", "two_pass"):
        raise ValueError(f"gemv split_reduce must be 'counter', 'atomic' or 'two_pass', got {reduce!r}")
    num_k_tiles = -(-k // bk)
    split = min(user.split_k, num_k_tiles) if user.split_k else _fill_split(-(-n // bn), num_k_tiles, sms)
    k_per_split = -(-num_k_tiles // split) * bk  # whole tiles per split
    split = -(-k // k_per_split)
    use = config is not None or (m <= GEMV_MAX_M and n * k <= GEMV_MAX_WEIGHT_ELEMS)
    pdl = USE_PDL if user.pdl is None else user.pdl
    return GemvPlan(use, kernel, block_m, bn, bk, split, k_per_split, reduce, warps, stages, pdl)
