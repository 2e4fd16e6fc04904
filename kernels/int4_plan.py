"""Launch choices of the W4A16 GEMM (``kernels.int4_gemm``): which kernel runs a shape (the GEMVs of
``kernels.int4_gemv`` and the tensor-core kernels for a few rows, tl.dot tiles above) and its tiles,
split-K and reduction. The defaults are named constants; each comment says which H200 measurement set it,
or which ``loadtest.int4_gemm_sweep`` row is to decide it.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from kernels._triton import next_pow2
from kernels.int4_config import Int4GemmConfig, Int4Launch, Kernel, SplitReduce
from kernels.int4_dequant import PACK
from kernels.int4_gemm_wgmma import check_tile
from kernels.int4_gemv_mma import PERMUTE_SPAN
from kernels.int4_gemv_stream import stream_fits

GEMV_MAX_M = 4  # the default kernel is the GEMV up to this many rows (pick_config says why)
# The factored GEMV's codes as subnormals (kernels.int4_gemv.subnormal: an and per weight) instead of as
# 1 + code / 16 (a shift and an and-or) everywhere, not only on wide layers (GEMV_WIDE_N): H200 at 5da38c4,
# M = 1, sweep row "gemv sub" against "gemv": qkv 9.5 vs 8.9 us, o 7.6 vs 7.3, down 16.5 vs 16.5, gate_up 28.0
# vs 28.7; the int4 model 2.720 vs 2.712 ms. PAGEDSERVE_INT4_SUBNORMAL=1 turns it on (for a same-run A/B).
GEMV_SUBNORMAL = os.environ.get("PAGEDSERVE_INT4_SUBNORMAL", "0") == "1"
# The factored GEMV loads bf16 x as int32 pairs and makes each value fp32 with one shift or and (kernels.int4_gemv.
# _load_x_words) instead of bf16 loads and conversions (sm_90 K loop, Triton 3.7: the default 4-warp tile 4.6
# instructions a weight against 6.4; the gated down projection's loads are already cheap and keep theirs). H100,
# Session 37 (layout_bench at M = 1, us): qkv 8.6 vs 8.9, o, gate_up and down the same; the int4 model 2.582 vs
# 2.608 / 2.613 ms in two runs. PAGEDSERVE_INT4_X_WORDS=0 turns it off (int4_bench's variant "split").
GEMV_X_WORDS = os.environ.get("PAGEDSERVE_INT4_X_WORDS", "1") == "1"
# The factored GEMV as stream-K (kernels.int4_gemv_stream: programs_per_sm x SMs programs, each an even run of the
# layer's (column tile, K tile) units in one pipeline) instead of a split-K grid, whose programs at M = 1 on the 8B
# shapes do 1-2 K tiles each (4 on down) in more than one wave; on layers of at least GEMV_STREAM_MIN_WEIGHTS, with
# GEMV_STREAM_BLOCK_N columns and subnormal codes (GEMV_STREAM_SUBNORMAL). H100, Session 37 (layout_bench at M = 1,
# us, against the split launch): gate_up (117 M weights) 26.1 vs 26.5, down (59 M) 15.7 vs 16.2; qkv (25 M) 9.9 vs
# 9.0 and o (17 M) 7.6 vs 6.9, so those keep the split grid; at 256 columns, or without subnormal codes on down,
# stream-K lost everywhere (docs/benchmarks.md). The int4 model with these four settings and pairs: 2.554 / 2.559 ms
# against 2.608 / 2.613 (0.449x bf16's 5.690). Not yet run on an H200. PAGEDSERVE_INT4_STREAM=0 turns it off
# (int4_bench's variants "nostream" and "split").
GEMV_STREAM = os.environ.get("PAGEDSERVE_INT4_STREAM", "1") == "1"
GEMV_STREAM_MIN_WEIGHTS = int(os.environ.get("PAGEDSERVE_INT4_STREAM_MIN_WEIGHTS", str(1 << 25)))
# Stream-K on wide layers too (GEMV_WIDE_N: gate_up); off, they keep the one-warp wide split tile (with pairs). H100,
# Session 39 (layout_bench, us): gate_up's split launch with pairs 25.74 / 25.78 against the stream launch's 26.44 /
# 26.71 (Session 37: 26.5 against 26.1); the model ("widesplit", off) 2.567 / 2.569 ms against 2.577 / 2.575. Bracketed
# by the defaults run again (Session 40, H100) it lost: 2.545 / 2.542 against 2.536 / 2.537 / 2.541 ms, so stream-K
# stays on (an H200, where the split tile's 3.02 instructions a weight against 3.34 may weigh more, has not run it).
# PAGEDSERVE_INT4_STREAM_WIDE=0 turns it off.
GEMV_STREAM_WIDE = os.environ.get("PAGEDSERVE_INT4_STREAM_WIDE", "1") == "1"
# Stream launches' tile: this many columns with 4 warps on every layer (the wide one too); 0: the split launch's
# tiles. A stream grid needs no column tiles for its parallelism, so wider tiles let more columns share each x value
# (sm_90 K loop with pairs: 3.97 instructions a weight at 512 columns, 4.57 at 256).
GEMV_STREAM_BLOCK_N = int(os.environ.get("PAGEDSERVE_INT4_STREAM_BLOCK_N", "512"))
# Subnormal codes on stream launches (GEMV_SUBNORMAL puts them on every factored launch): down at 512 columns
# 15.7 us with them against 16.7 without (H100, Session 37).
GEMV_STREAM_SUBNORMAL = os.environ.get("PAGEDSERVE_INT4_STREAM_SUBNORMAL", "1") == "1"
# A stream grid is one wave: the one-warp wide tile (250-254 registers on sm_90, 161 with x_words) holds 8 programs an
# SM by registers (64 K of them), not GEMV_WIDE_TILE's 16, which the split grid runs in waves.
GEMV_STREAM_WIDE_PPS = 8
# tl.dot split-K up to 64 rows: at least this much up to 16 rows (one 16-row tile), even where the column tiles alone
# fill the SMs (gate_up's 224 at 128 columns: split 2, 32 K tiles a program), and exactly this much from 17 to 64.
# H200, Session 14 (int4_bench rows "fused" and "dot split8", the 8B shapes, same run): gate_up 75.0 -> 64.0 us at
# M = 8; at M = 8 o and down keep the 16 that filling the SMs gives them (split 8: 13.6 -> 14.1 and 36.2 -> 39.1 us),
# at M = 64 they take 8 (21.0 -> 16.8 and 43.8 -> 43.0 us). A layer's four projections: 142.6 -> 132.3 us at M = 8,
# 178.1 -> 166.2 at M = 64 (bf16 cuBLAS 122.1 / 130.9). M = 32 (32-row tiles, Session 15, before the codes were masked
# in place): 168.4 us a layer, 0.73x cuBLAS; not swept.
DOT_SPLIT = 8
ATOMIC_MAX_M = 64  # the default split-K reduction is "atomic" up to this many rows, "counter" above
UNPACK_M = (GEMV_MAX_M + 1, 127)  # tl.dot with unpack_in_registers by default at these M (_pick_dot says why)
PREFILL_M = 1024  # tl.dot tiles of 256 rows from this M on
GEMV_LIMIT_M = 16  # the GEMV holds a tile's [M, BLOCK_K / 8, BLOCK_N] fp32 products in registers
GEMV_PROGRAMS_PER_SM = 4  # GEMV split-K target: enough programs per SM to keep loads in flight
# Programs an SM of the GEMV_STREAM_BLOCK_N stream launches: the stream grid is one wave, so no more than the SM
# holds by registers (sm_90: 67 registers at 512 columns, 126 gated, hold 4; 1024 columns, 147 / 168 registers, hold
# 3: int4_model's "bn1024", which lost on an H100, Session 38: gate_up 27.2 against 26.6 us, down 16.8 against 15.8,
# the model 2.641 against 2.588 ms; not yet run on an H200).
GEMV_STREAM_PPS = GEMV_PROGRAMS_PER_SM
# The GEMV at M = 1 on wide layers (at least GEMV_WIDE_N columns: the 8B gate_up's 28672): codes as subnormals
# and GEMV_WIDE_TILE = (block_n, num_warps, programs per SM), 8 columns per thread instead of 2 (sm_90 SASS of the
# loop: 3.02 instructions per weight against 4.98). H200 at 5da38c4 (int4_bench --m 1, sweep row "gemv sub w1
# pps16"): gate_up 23.5 us against the default's 28.7 (0.62 against 0.50 of the copy bandwidth); on qkv, o and
# down (N <= 6144) that tile lost 0.3-0.7 us to the default and subnormal codes alone lost 0-0.6 us.
GEMV_WIDE_N = 16384
GEMV_WIDE_TILE = (256, 1, 16)
# A second decode GEMV, gemv_cols (each thread owning whole columns, ~3.2 instructions a weight), lost to the GEMV
# at M = 1-2 by 1.1-1.4x on the H200 (docs/benchmarks.md, 2026-12-01) and to the MMA kernel at 2-16 since; it was
# removed in Session 28.
# kernels.int4_gemv_mma (Gluon, tensor cores): the default kernel at MMA_M rows. At M = 2-8 (H200, Session 23;
# us for qkv / o / gate_up / down) M = 2: 10.1 / 7.8 / 29.9 / 17.0 against the GEMV's 13.6 / 9.5 / 44.3 / 24.0, M = 8:
# 10.2 / 9.2 / 30.7 / 17.6 against tl.dot's 16.4 / 12.6 / 60.8 / 32.5. At M = 1 the GEMV stays (23.5 against 29.2 on
# gate_up) and fuses the norms, the activation and the residual. Removed after they lost in the model: the next
# tile's words and x loaded ahead in registers; vector loads of the words.
# The GEMV (M = 1) and the MMA GEMV launched with programmatic dependent launch on sm_90+ (kernels.pdl; Session 24):
# the int4 8B model at batches 1 / 2 / 4 / 8 2.487 / 2.780 / 2.848 / 3.031 ms without any PDL, 2.400 / 2.742 / 2.809
# / 2.995 with these GEMVs', 2.295-2.324 at batch 1 with the RMSNorm's and decode kernels' too. PAGEDSERVE_INT4_PDL=0
# turns it off.
GEMV_PDL = os.environ.get("PAGEDSERVE_INT4_PDL", "1") != "0"
# Above 8 rows the MMA kernel takes x MMA_BLOCK_M rows a program, and from MMA_DEQUANT_BLOCK_M rows it dequantizes
# each weight to (c - z) s in registers (no per-group sums or row-sum MMA, which grow with the rows). H200, Session 25
# (docs/benchmarks.md; a layer's four projections): M = 16 81.4 us against tl.dot's 120.8 (factored: 95.4); 16-row
# tiles beat 32-row ones at 24 rows (135.3 against 182.4); from 17 rows the wgmma GEMM (below) wins.
MMA_M = (2, 16)
MMA_BLOCK_M = 16
MMA_DEQUANT_BLOCK_M = 16
# by block_m: (block_n, block_k, num_warps, programs per SM); sm_90 compile (K, N and K ranges divisible by 16, as
# Triton specializes them at launch): 72 registers at 8 rows, 120 at 16, 148 at 32, and at 64 255 with 16 bytes of
# spills (32 and 64: a user's block_m); 2 programs per SM from 16 rows (1.08x faster at 16)
_MMA_TILES = {8: (128, 128, 4, 4), 16: (128, 128, 4, 2), 32: (128, 64, 4, 2), 64: (128, 64, 4, 2)}


@lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 8  # interpreter on CPU: any small number
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _fill_split(tiles: int, k_tiles: int, target: int, max_split: int) -> int:
    """Split-K doubled until ``tiles * split`` reaches ``target`` programs, keeping a K tile per split."""
    split = 1
    while tiles * split < target and split * 2 <= k_tiles and split < max_split:
        split *= 2
    return split


def _reduce(user: Int4GemmConfig, m: int, split: int) -> SplitReduce:
    """The user's reduction or the default for M; "counter" when nothing is split (one description of
    one launch)."""
    if split == 1:
        return "counter"
    return user.split_reduce or ("atomic" if m <= ATOMIC_MAX_M else "counter")


def default_kernel(m: int) -> Kernel:
    """The kernel M rows get unless the caller picks one (``kernels.int4_gemm`` falls back where it can't run)."""
    if MMA_M[0] <= m <= MMA_M[1]:
        return "mma"
    if WGMMA_M[0] <= m <= WGMMA_M[1]:
        return "wgmma"
    return "gemv" if m <= GEMV_MAX_M else "dot"


def pick_config(
    m: int, n: int, k: int, group_size: int, num_sms: int, user: Int4GemmConfig, has_g_idx: bool = False
) -> Int4Launch:
    """The tensor-core GEMV at MMA_M rows (2-16; kernels.int4_gemv_mma, Sessions 23 and 25), the wgmma GEMM at WGMMA_M
    (17-128, kernels.int4_gemm_wgmma, Session 25), else the GEMV up to GEMV_MAX_M rows and the tl.dot path above;
    split-K summed by atomics up to ATOMIC_MAX_M
    rows. The defaults are the winners of one H200 run (``int4_bench --mixed`` at 7f8955d, Llama-3-8B layer
    shapes; per M, the geometric mean over the shapes of time / the best variant's): the GEMV beat tl.dot
    2.8x at M = 1 and 1.4x at M = 4, tl.dot beat the GEMV 1.2x at M = 8 and 2.5x at M = 16; the atomic
    reduction beat the counter by 6 % at M = 1, 13 % at M = 2, 33 % at M = 4 and 4-5 % at M = 8-64 (the
    atomic results at M = 4-8 and 256 were wrong then, fixed since; M = 256 keeps the counter it was
    measured with)."""
    kernel = user.kernel or default_kernel(m)
    if kernel == "mma" and user.split_reduce == "counter":  # a deterministic sum: the MMA has atomics only
        if user.kernel == "mma":
            raise ValueError("the mma kernel sums split-K with atomics only (split_reduce='atomic' or None)")
        kernel = "gemv" if m <= GEMV_MAX_M else "dot"
    if kernel == "mma" and (has_g_idx or group_size % PERMUTE_SPAN):
        kernel = "gemv" if m <= GEMV_LIMIT_M else "dot"  # act-order, odd groups: what the MMA can't run
    if kernel == "mma":
        return _pick_mma(m, n, k, group_size, num_sms, user)
    if kernel == "wgmma" and user.split_reduce == "counter":  # as the MMA's: atomics only
        if user.kernel == "wgmma":
            raise ValueError("the wgmma kernel sums split-K with atomics only (split_reduce='atomic' or None)")
        kernel = "dot"
    if kernel == "wgmma" and (has_g_idx or group_size % PERMUTE_SPAN):
        kernel = "dot"
    if kernel == "wgmma":
        return _pick_wgmma(m, n, k, group_size, num_sms, user)
    if kernel == "gemv":
        return _pick_gemv(m, n, k, group_size, num_sms, user, has_g_idx)
    return _pick_dot(m, n, k, group_size, num_sms, user)


def _pick_mma(m: int, n: int, k: int, group_size: int, num_sms: int, user: Int4GemmConfig) -> Int4Launch:
    """_MMA_TILES by block_m (rows of x a program takes: M's power of two from 8, at most MMA_BLOCK_M); block_k
    at most the group's largest power-of-two divisor; dequantized weights from MMA_DEQUANT_BLOCK_M rows (``factored``
    forces either); split-K filled to the tile's programs per SM, summed by atomics (the kernel's only
    reduction)."""
    bm = user.block_m or min(max(8, next_pow2(m)), MMA_BLOCK_M)
    if bm < 8 or bm & (bm - 1):
        raise ValueError(f"mma: block_m {bm} must be a power of two from 8")
    tile_bn, tile_bk, tile_warps, tile_pps = _MMA_TILES[min(bm, 64)]
    bn, warps = user.block_n or tile_bn, user.num_warps or tile_warps
    bk = user.block_k or min(tile_bk, group_size & -group_size)
    if bk % PERMUTE_SPAN or group_size % bk or bn % (16 * warps):
        raise ValueError(
            f"mma: block_k {bk} must be a multiple of 32 dividing the group, block_n a multiple of 16 * warps"
        )
    target = (user.programs_per_sm or tile_pps) * num_sms
    split = user.split_k or _fill_split(-(-n // bn) * -(-m // bm), -(-k // bk), target, 32)
    factored = bm < MMA_DEQUANT_BLOCK_M if user.factored is None else user.factored
    return Int4Launch(
        "mma", bm, bn, bk, split, "atomic" if split > 1 else "counter", warps, 1,
        unpack_in_registers=False, factored=factored, pdl=GEMV_PDL if user.pdl is None else user.pdl,
    )  # fmt: skip


# kernels.int4_gemm_wgmma (Hopper's warpgroup MMA): the default at WGMMA_M rows on sm_90 (tl.dot elsewhere), where
# the linear layer then does not dequantize for cuBLAS (int4_linear). H200, Session 25 (a layer's four projections,
# 128 k's a tile): 97.8 us at M = 32 against the MMA kernel's 136.5, 131.3 at 64 against tl.dot's 159.4, 219.5 at 128
# against dequantization + cuBLAS's 288.1, which won at 256 and 512. PAGEDSERVE_INT4_WGMMA=0 turns it off.
WGMMA_M = (17, 128) if os.environ.get("PAGEDSERVE_INT4_WGMMA", "1") != "0" else (1 << 30, 1 << 30)
WGMMA_TILE = (64, 64, 128, 2)  # (block_m cap, block_n, block_k, programs per SM): 141 registers on sm_90, no spills
# one warpgroup a program: two sharing x's tile (8 warps, block_n 128) took 1.14-1.72x its time at 64-512 rows (H200,
# Session 33, sweep row "wgmma w8"); the pipelined K loops that lost in the same sweep are removed
WGMMA_WARPS = 4


def _pick_wgmma(m: int, n: int, k: int, group_size: int, num_sms: int, user: Int4GemmConfig) -> Int4Launch:
    """WGMMA_TILE: block_m M's power of two from 8 up to its cap (the MMA's N), block_k at most the group's largest
    power-of-two divisor, one warpgroup (or ``user.num_warps`` 8: two sharing x's tile); split-K filled to the
    tile's programs per SM, summed by atomics."""
    cap, tile_bn, tile_bk, pps = WGMMA_TILE
    bm = user.block_m or min(max(8, next_pow2(m)), cap)
    bn, bk = user.block_n or tile_bn, user.block_k or min(tile_bk, group_size & -group_size)
    warps = user.num_warps or WGMMA_WARPS
    check_tile(bm, bn, bk, group_size, warps)
    target = (user.programs_per_sm or pps) * num_sms
    split = user.split_k or _fill_split(-(-n // bn) * -(-m // bm), -(-k // bk), target, 32)
    return Int4Launch(
        "wgmma", bm, bn, bk, split, "atomic" if split > 1 else "counter", warps, 1, unpack_in_registers=False,
        factored=False,
    )  # fmt: skip


# by block_m: the fewest instructions per weight and row (sm_90 SASS), but M = 1: 64, not 128, was 4-6 % faster
# on qkv, gate_up and down_proj at 7f8955d (H200; 72 registers instead of 96)
_GEMV_BLOCK_K = {1: 64, 2: 64, 4: 32, 8: 32, 16: 16}


def _pick_gemv(
    m: int, n: int, k: int, group_size: int, num_sms: int, user: Int4GemmConfig, has_g_idx: bool
) -> Int4Launch:
    """block_n 256 with 4 warps: 8 columns per thread share each activation's conversion and sum (3.98
    instructions per weight at M = 1 against 4.27 at block_n 128; block_n 128 measured 1.13x the best at
    M = 1); block_k shrinks as rows are added so the [M, block_k / 8, block_n] products stay in registers
    (72 at M = 1, 128 at M = 2, 96 at M = 4, 196 at M = 8); the tile stays inside one group. Split-K until
    ~4 programs per SM (one wave that keeps loads in flight; split 8 measured 1.30x the best at M = 1, the
    whole K per program 3.4x). Two stages: one stage is not pipelined and spills (255 registers)."""
    if m > GEMV_LIMIT_M:
        raise ValueError(f"the GEMV holds all M rows in registers: M={m} > {GEMV_LIMIT_M}; use kernel='dot'")
    block_m = next_pow2(m)
    bk = user.block_k or _GEMV_BLOCK_K[block_m]
    group_pow2 = group_size & -group_size  # largest power of two dividing the group
    if not has_g_idx and group_pow2 >= PACK:
        bk = min(bk, group_pow2)  # every tile inside one group
    wide = block_m == 1 and n >= GEMV_WIDE_N
    factored = (user.factored is None or user.factored) and not has_g_idx and group_size % bk == 0
    stream = factored and stream_fits(k, group_size, bk, has_g_idx) and _stream(user, n * k, wide)
    bn_default, warps, pps = GEMV_WIDE_TILE if wide else (256, 4, GEMV_PROGRAMS_PER_SM)
    if stream and GEMV_STREAM_BLOCK_N:
        bn_default, warps, pps = GEMV_STREAM_BLOCK_N, 4, GEMV_STREAM_PPS
    elif stream and (user.num_warps or warps) == 1:
        pps = GEMV_STREAM_WIDE_PPS  # one wave of the one-warp tile (the split grid's 16 is ~2)
    bn = user.block_n or bn_default
    target = (user.programs_per_sm or pps) * num_sms
    split = user.split_k or _fill_split(-(-n // bn), -(-k // bk), target, 32)
    sub_default = GEMV_SUBNORMAL or wide or (stream and GEMV_STREAM_SUBNORMAL)
    subnormal = factored and (sub_default if user.subnormal is None else user.subnormal)
    return Int4Launch(
        "gemv", block_m, bn, bk, split, _reduce(user, m, split), user.num_warps or warps, user.num_stages or 2,
        unpack_in_registers=False, factored=factored, subnormal=subnormal,
        pdl=GEMV_PDL if user.pdl is None else user.pdl, x_words=GEMV_X_WORDS if user.x_words is None else user.x_words,
        stream_programs=target if stream else 0,
    )  # fmt: skip


def _stream(user: Int4GemmConfig, weights: int, wide: bool) -> bool:
    """Whether a factored GEMV launch is stream-K: the user's choice, else GEMV_STREAM on layers of at least
    GEMV_STREAM_MIN_WEIGHTS weights (wide ones only with GEMV_STREAM_WIDE) where the user left the split to the plan
    (a split_k or the deterministic counter reduction asks for the split grid)."""
    split_asked = user.split_k is not None or user.split_reduce == "counter"
    if user.stream and split_asked:
        raise ValueError("a stream GEMV has no split_k and sums with atomics: leave split_k and split_reduce unset")
    if user.stream is not None:
        return user.stream
    return GEMV_STREAM and not split_asked and weights >= GEMV_STREAM_MIN_WEIGHTS and (GEMV_STREAM_WIDE or not wide)


def _pick_dot(m: int, n: int, k: int, group_size: int, num_sms: int, user: Int4GemmConfig) -> Int4Launch:
    """Tiles from H200 runs: block_k 64 beat 128 by ~20 % at M <= 16 (an earlier run); at M = 4096
    (7f8955d) block_m 256 beat 128 by 8-11 % on every shape (8 warps, 3 stages: 255 registers and ~300 B of
    spills in the sm_90 compile, faster all the same), block_k 128 was 1.43x the best and block_n 256 lost.
    Split-K until ~2 programs per SM up to M = 256 (split 4 halved down_proj at M = 256).
    unpack_in_registers (each packed word loaded once and replicated to its 8 rows in registers instead of
    loaded once per row: 8x less L2 and shared-memory traffic, ~15 % more instructions), at 7f8955d against
    per-row loads: 2 % faster at M = 16, 1.4x at M = 64, 1.24x at M = 4096, but per-row loads were best on
    3 of 4 shapes at M = 256 (down_proj 72.5 vs 80.8 us; 1.05 vs 1.08 of the best over the shapes). The
    second H200 run (b066a95, block_m 256 at M >= 1024) turned M = 8-16 and 4096 to per-row loads (time /
    best 1.01 vs 1.04 at M = 8 and 16, 1.00 vs 1.13 at M = 4096; 1.07 each at M = 256) and kept unpacking at
    M = 64 (per-row 1.46x). Third (same-run A/B against e92056a): with each nibble's shift from the tile's
    row index, not from k (loop-invariant) and codes made floats without a conversion
    (``kernels.int4_dequant.code_minus_zero``), the sm_90 loop lost 13-35 % of its instructions and unpacking
    won every shape at M = 8 and 16 too (qkv 21.1 vs 21.7 us, o 14.8 vs 18.1, gate_up 82.9 vs 96.5, down 41.0
    vs 47.3 at M = 8; per-row loads took 1.82x its time at M = 64, 1.47x before): UNPACK_M, up to the rows
    where the linear layer dequantizes instead (DEQUANT_MIN_M). With that loop, block_n 128 (and split-K filled to
    2 programs per SM again) beat 64 (the sweep's "dot bn128", same session): the four projections of a layer
    143.8 vs 161.2 us at M = 16 (o 13.9 vs 15.0), 178.7 vs 183.9 at M = 64 (o lost there: 21.1 vs 17.3); M = 5-15
    run M = 16's launch. Applying scale and zero per tile to the sums instead of per weight (codes as half floats
    with one or: 13 % fewer instructions at M = 16) took 1.3-1.95x as long (each tile's MMA then starts from zero
    and is waited for): deleted. Fourth (Session 15): codes masked in place (``kernels.int4_dequant.codes_tile``),
    same tiles: a layer's four projections 132.3 -> 119.6 us at M = 8 (1.06x bf16 cuBLAS), 165.5 -> 157.7 at M = 64."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 128, 64, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 32 if m <= 32 else 64, 128, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 256 if m >= PREFILL_M else 128 if m >= 128 else 64, 128, 64, 8, 3
    bm, bn, bk = user.block_m or bm, user.block_n or bn, user.block_k or bk
    if bm < 16 or bk < 16:
        raise ValueError(f"tl.dot needs block_m and block_k >= 16, got {bm} and {bk}")
    if group_size < bk and group_size >= 16 and group_size & (group_size - 1) == 0:
        bk = group_size  # one scale row per tile
    split = user.split_k
    if split is None:
        split = _fill_split(-(-m // bm) * -(-n // bn), -(-k // bk), 2 * num_sms, 16) if m <= 256 else 1
        if m <= 16:
            split = max(split, min(DOT_SPLIT, -(-k // bk)))
        elif m <= 64:
            split = min(DOT_SPLIT, -(-k // bk))
    unpack = user.unpack_in_registers
    if unpack is None:
        unpack = UNPACK_M[0] <= m <= UNPACK_M[1]
    return Int4Launch(
        "dot", bm, bn, bk, split, _reduce(user, m, split), user.num_warps or warps, user.num_stages or stages,
        unpack_in_registers=unpack, factored=False,
    )  # fmt: skip
