"""Decode path of the W4A16 GEMM (``kernels.int4_gemm``, same weight layout).

GEMV (small M, no ``tl.dot``): a program owns ``BLOCK_N`` output columns of all M rows and one K range. Per
tile it loads the packed words ``[BLOCK_K // 8, BLOCK_N]`` once (contiguous along N) and the activations as
``[M, BLOCK_K // 8, 8]`` (row ``i`` of the words holds the codes of ``x[:, 8 i : 8 i + 8]``), unpacks nibble
``j`` of every word in registers and accumulates into ``[M, BLOCK_K // 8, BLOCK_N]`` fp32; the sum over the
word rows happens once, after the K loop. At M = 1 a weight costs a few instructions while the GPU streams
only half a byte of it, so the kernel counts instructions:

- factored (the default without g_idx): a tile lies inside one group, so ``sum_k (c_k - z) s x_k =
  s (sum_k c_k x_k - z sum_k x_k)``; scale and zero are applied once per word row and column, not per
  weight. A code becomes a float without an int->float conversion (a quarter-rate instruction): shifted to
  the top 4 mantissa bits of 1.0 it reads as ``1 + c / 16`` (one shift and one and-or), and the ``1`` is
  taken back out with ``sum_k x_k``. Not bit-identical to the reference, which rounds every weight to the
  scales' dtype first; closer to the exact sum than that rounding (fp32 throughout).
- exact (g_idx act-order, or ``factored=False``): each weight ``(c - z) * s`` rounded to the scales' dtype
  and then to x's, as the reference computes it, before the fp32 multiply-add.

Split-K (``SPLIT_MODE``) when N alone does not give every SM enough programs, reduced in the same launch
(``kernels.int4_split``).

Gated (``GATED``, ``kernels.int4_gemm.int4_gemm_gated``): x points at the MLP's gate_up output ``x2 [M, 2K]`` and
every load of x loads gate and up and takes ``silu(gate) * up`` rounded as ``silu_and_mul_ref``, so the down
projection needs no activation launch; the GEMV arithmetic after the load is unchanged.

"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, tl, triton
from kernels.activation import silu_mul
from kernels.int4_split import finish_tile, split_target
from kernels.pdl import launch_dependents, pdl_supported, wait_prior_grids

# ---- GEMV ----


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """``tl.load`` masked (zeros outside) unless ``EVEN`` says no element is outside."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _load_x(ptrs, mask, up_offset, GATED: tl.constexpr):
    """x at ``ptrs``, zeros outside ``mask``. GATED: ``silu(gate) * up`` (``kernels.activation.silu_mul``) of the
    gate at ``ptrs`` and the up ``up_offset`` elements on; zeros outside ``mask`` still (silu(0) * 0)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if GATED:
        x = silu_mul(x, tl.load(ptrs + up_offset, mask=mask, other=0.0))
    return x


@triton.jit
def _bf16_pairs(ptrs, mask):
    """The bf16 pairs at int32 ``ptrs [BM, R, 4]`` as fp32 ``[BM, R, 8]`` (element 2i the low half of word i):
    a shift or an and a value, no conversion."""
    w = tl.load(ptrs, mask=mask, other=0)
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (w.shape[0], w.shape[1], 8))


@triton.jit
def _load_x_words(x_ptr, k0, offs_m, offs_i, M, stride_xm):
    """The factored tile's x (bf16, unit stride along K, 4-byte aligned rows, whole tiles) loaded as int32 pairs:
    fp32 ``[BM, R, 8]`` of the tile at ``k0``."""
    words = k0 // 2 + 4 * offs_i[:, None] + tl.arange(0, 4)[None, :]  # [R, 4]
    ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + offs_m[:, None, None] * (stride_xm // 2) + words[None, :, :]
    return _bf16_pairs(ptrs, (offs_m < M)[:, None, None])


@triton.jit
def tile_words(qw_ptr, k0, k_end, offs_i, offs_n, mask_n, stride_qk, EVEN: tl.constexpr):
    """The packed words ``[R, BN]`` int32 of the K tile at ``k0`` (word row ``i`` holds ``k0 + 8 i .. + 7``)."""
    rows = k0 // 8 + offs_i  # [R] word rows
    w_ptrs = qw_ptr + rows[:, None] * stride_qk + offs_n[None, :]
    return _load(w_ptrs, (rows * 8 < k_end)[:, None] & mask_n[None, :], EVEN)


@triton.jit
def tile_x(
    x_ptr, k0, k_end, offs_m, offs_i, M, stride_xm, stride_xk, up_offset,
    EVEN: tl.constexpr, GATED: tl.constexpr, X_WORDS: tl.constexpr,
):  # fmt: skip
    """The factored tile's x at ``k0`` as fp32 ``[BM, R, 8]``: as int32 pairs (``X_WORDS``, :func:`_load_x_words`)
    or value by value (``GATED``: the activation of gate and up, :func:`_load_x`); zeros past M and ``k_end``."""
    if X_WORDS:
        return _load_x_words(x_ptr, k0, offs_m, offs_i, M, stride_xm)
    xk = k0 + 8 * offs_i[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
    mask_x = (offs_m < M)[:, None, None] & ((xk < k_end)[None, :, :] | EVEN)  # rows past M: always
    x_ptrs = x_ptr + offs_m[:, None, None] * stride_xm + xk[None, :, :] * stride_xk  # [BM, R, 8]
    return _load_x(x_ptrs, mask_x, up_offset, GATED).to(tl.float32)


@triton.jit
def nibble(words, J: tl.constexpr, one_bits):
    """Nibble ``J`` of every word as the fp32 ``1 + code / 16``: the code moved to bits 19..22 (the top of
    the mantissa) and or-ed with ``one_bits`` (1.0's bits), instead of an int->float conversion. The bits
    come in as a kernel argument: with the literal, ptxas emits the and and the or as two LOP3s, not one."""
    bits = (words << (19 - 4 * J)) if 4 * J <= 19 else (words >> (4 * J - 19))
    return ((bits & 0x780000) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def subnormal(words, P: tl.constexpr):
    """The nibble at bits ``P..P+3`` (``P <= 16``) of every word, masked in place, read as the fp32 subnormal
    ``code * 2**(P - 149)``: one and per weight, no shift (its activation is scaled by ``2**(64 - P)`` instead,
    once per activation, :func:`factored_tile`). Needs the GPU to keep fp32 subnormals, which Triton's
    multiply-adds do (no ftz); exact, unlike ``nibble``'s ``1 + code / 16``, whose ``1`` cancels later."""
    return (words & (0xF << P)).to(tl.float32, bitcast=True)


@triton.jit
def _split8(x, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """``[BM, R, 8]`` -> its 8 slices ``[BM, R]`` along the last dim (register moves, no data movement)."""
    even, odd = tl.split(tl.reshape(x, (BLOCK_M, ROWS, 4, 2)))  # j = 2 a + b: b = 0 | 1
    e0, e1 = tl.split(tl.reshape(even, (BLOCK_M, ROWS, 2, 2)))  # a = 2 c + d: j in {0, 4} | {2, 6}
    o0, o1 = tl.split(tl.reshape(odd, (BLOCK_M, ROWS, 2, 2)))  # j in {1, 5} | {3, 7}
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def factored_tile(
    words, x, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N, one_bits,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EVEN: tl.constexpr, SUBNORMAL: tl.constexpr,
):  # fmt: skip
    """One tile of group ``g``: ``s (sum_k c_k x_k - z sum_k x_k)`` ``[BM, BN]`` (x fp32 ``[BM, R, 8]``)."""
    if SUBNORMAL:
        return _subnormal_tile(words, x, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N, BLOCK_M, ROWS, EVEN)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x, BLOCK_M, ROWS)
    t = nibble(words, 0, one_bits)[None, :, :] * x0[:, :, None]  # [BM, R, BN]: sum_j (1 + c_j / 16) x_j
    t += nibble(words, 1, one_bits)[None, :, :] * x1[:, :, None]
    t += nibble(words, 2, one_bits)[None, :, :] * x2[:, :, None]
    t += nibble(words, 3, one_bits)[None, :, :] * x3[:, :, None]
    t += nibble(words, 4, one_bits)[None, :, :] * x4[:, :, None]
    t += nibble(words, 5, one_bits)[None, :, :] * x5[:, :, None]
    t += nibble(words, 6, one_bits)[None, :, :] * x6[:, :, None]
    t += nibble(words, 7, one_bits)[None, :, :] * x7[:, :, None]
    xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # [BM, R]
    s = _load(s_ptr + g * stride_sg + offs_n, offs_n < N, EVEN).to(tl.float32)
    z = _load(z_ptr + g * stride_zg + offs_n, offs_n < N, EVEN).to(tl.float32)
    # sum_k (c_k - z) x_k = 16 sum t - (16 + z) sum xs; summed over the tile's word rows here, not after
    # the loop: a loop-carried [BM, R, BN] accumulator made Triton spread N one column per thread
    return (16.0 * s)[None, :] * tl.sum(t, axis=1) - (s * (16.0 + z))[None, :] * tl.sum(xs, axis=1)[:, None]


# Subnormal nibbles (the ``subnormal`` GEMV): nibble j sits at bit P_j of its word, nibbles 5-7 after one shift by
# 12 of the word (bits 20-31 to 8-19: a subnormal needs its bits below 23). Its activation is scaled by
# 2**(64 - P_j), so every product is code * x * 2**-85: normal while |code * x| >= 2**-41, finite while
# |x| < 2**64 (bf16 activations are far inside both); the sum is scaled back once per tile, by 2**85.


@triton.jit
def _subnormal_tile(
    words, x, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """:func:`factored_tile` with :func:`subnormal` codes: ~1.1 integer instructions per weight (an and,
    and a shift per word for three of them) against ``nibble``'s two."""
    t = _subnormal_products(words, x * subnormal_scales()[None, None, :], BLOCK_M, ROWS)  # x_j 2**(64 - P_j), exact
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x, BLOCK_M, ROWS)
    # in factored_tile's order, not tl.sum's: that one follows x's layout, which its load path sets (pairs or values),
    # so the gated GEMV and the activation + GEMV would differ in the last bits
    xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # [BM, R]
    return _subnormal_sum(t, xs, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N, EVEN)


@triton.jit
def prepared_tile(
    words, x_up, xs, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """:func:`_subnormal_tile` of activations already scaled (``x_up`` fp32 ``[BM, R, 8]``, by
    :func:`subnormal_scales`) and summed by word row (``xs [BM, R]``, unscaled)."""
    t = _subnormal_products(words, x_up, BLOCK_M, ROWS)
    return _subnormal_sum(t, xs, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N, EVEN)


@triton.jit
def subnormal_scales():
    """``2**(64 - P_j)`` fp32 ``[8]``: what scales activation ``j`` of a word row for :func:`subnormal` codes."""
    j = tl.arange(0, 8)
    p = tl.where(j < 5, 4 * j, 4 * j - 12)  # [8] bit of nibble j in words (j < 5) or in words >> 12
    return ((191 - p) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _subnormal_products(words, x_up, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """``sum_j c_j x_j 2**-85`` ``[BM, R, BN]``: the codes as subnormals times the scaled activations."""
    y0, y1, y2, y3, y4, y5, y6, y7 = _split8(x_up, BLOCK_M, ROWS)
    hi = words >> 12  # arithmetic: the sign copies land in bits 20-31, above every mask below
    t = subnormal(words, 0)[None, :, :] * y0[:, :, None]
    t += subnormal(words, 4)[None, :, :] * y1[:, :, None]
    t += subnormal(words, 8)[None, :, :] * y2[:, :, None]
    t += subnormal(words, 12)[None, :, :] * y3[:, :, None]
    t += subnormal(words, 16)[None, :, :] * y4[:, :, None]
    t += subnormal(hi, 8)[None, :, :] * y5[:, :, None]
    t += subnormal(hi, 12)[None, :, :] * y6[:, :, None]
    t += subnormal(hi, 16)[None, :, :] * y7[:, :, None]
    return t


@triton.jit
def _subnormal_sum(t, xs, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N, EVEN: tl.constexpr):
    """``s (sum_k c_k x_k - z sum_k x_k)`` ``[BM, BN]`` from the products ``t`` and the word-row sums ``xs``."""
    s = _load(s_ptr + g * stride_sg + offs_n, offs_n < N, EVEN).to(tl.float32)
    z = _load(z_ptr + g * stride_zg + offs_n, offs_n < N, EVEN).to(tl.float32)
    return (3.8685626227668134e25 * s)[None, :] * tl.sum(t, axis=1) - (s * z)[None, :] * tl.sum(xs, axis=1)[:, None]


@triton.jit
def _exact_tile(
    words, x_ptr, s_ptr, z_ptr, g_ptr, k0, k_end, offs_m, offs_n, M, N,
    stride_xm, stride_xk, stride_sg, stride_zg, up_offset,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """One tile's ``sum_k w_k x_k`` ``[BM, BN]``, every weight dequantized and rounded as the reference does."""
    ROWS: tl.constexpr = words.shape[0]
    offs_i = tl.arange(0, ROWS)
    t = tl.zeros((offs_m.shape[0], ROWS, offs_n.shape[0]), dtype=tl.float32)
    mask_n = offs_n < N
    if ONE_GROUP_PER_TILE:
        g0 = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g0 * stride_sg + offs_n, mask=mask_n, other=0.0)[None, :]
        z = tl.load(z_ptr + g0 * stride_zg + offs_n, mask=mask_n, other=0)[None, :]
    for j in tl.static_range(8):
        k = k0 + 8 * offs_i + j  # [R]: the input feature of nibble j of each word row
        mask_k = k < k_end
        xj = _load_x(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
            (offs_m < M)[:, None] & mask_k[None, :], up_offset, GATED,
        )  # [BM, R]  # fmt: skip
        if not ONE_GROUP_PER_TILE:
            g = tl.load(g_ptr + k, mask=mask_k, other=0) if HAS_G_IDX else k // GROUP_SIZE
            mask_w = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask_w, other=0.0)
            z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=mask_w, other=0)
        c = (words >> (4 * j)) & 0xF
        w = ((c - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)).to(s.dtype)
        wx = w.to(xj.dtype).to(tl.float32)[None, :, :] * xj.to(tl.float32)[:, :, None]  # [BM, R, BN]
        t += wx
    return tl.sum(t, axis=1)


@triton.jit(do_not_specialize=["M"])  # one compile for every M of a block_m (M = 1 would be its own)
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, one_bits,
    stride_xm, stride_xk, stride_qk, stride_sg, stride_zg, stride_om,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, FACTORED: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr,
    SUBNORMAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    SPLIT_MODE: tl.constexpr, SPLIT_CHUNK: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr, TRIGGER: tl.constexpr, X_WORDS: tl.constexpr,
):  # fmt: skip
    """PDL (launched with ``launch_pdl``, ``kernels.pdl``): the program waits for the kernel before, first of all;
    TRIGGER: a PDL-launched next kernel may start once every program's K loop is done."""
    ROWS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, ROWS)
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    up_offset = K * stride_xk  # GATED: x is x2 [M, 2K], the up half K columns after the gate
    if PDL:
        wait_prior_grids()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # a dot-free loop is software-pipelined only when the loop itself carries num_stages
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        words = tile_words(qw_ptr, k0, k_end, offs_i, offs_n, mask_n, stride_qk, EVEN)
        if FACTORED:
            x = tile_x(x_ptr, k0, k_end, offs_m, offs_i, M, stride_xm, stride_xk, up_offset, EVEN, GATED, X_WORDS)
            g = k0 // GROUP_SIZE
            acc += factored_tile(
                words, x, s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, N, one_bits, BLOCK_M, ROWS, EVEN, SUBNORMAL,
            )  # fmt: skip
        else:
            acc += _exact_tile(
                words, x_ptr, s_ptr, z_ptr, g_ptr, k0, k_end, offs_m, offs_n, M, N,
                stride_xm, stride_xk, stride_sg, stride_zg, up_offset, GROUP_SIZE, HAS_G_IDX, ONE_GROUP_PER_TILE, GATED,
            )  # fmt: skip
    if TRIGGER:
        launch_dependents()
    finish_tile(
        acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_n, pid_k, tl.num_programs(1), SPLIT_MODE,
        SPLIT_CHUNK,
    )  # fmt: skip


def int4_gemv_launch(
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) when gated
    qweight: torch.Tensor,  # [K // 8, N] int32, contiguous along N
    scales: torch.Tensor,  # [num_groups, N], contiguous along N
    zeros: torch.Tensor,  # [num_groups, N] uint8, contiguous along N
    group_size: int,
    g_idx: torch.Tensor | None,  # [K] int32
    out: torch.Tensor,  # [M, N] contiguous, x.dtype
    *,
    block_n: int,
    block_k: int,
    split_k: int,
    split_reduce: str,
    factored: bool,
    num_warps: int,
    num_stages: int,
    subnormal: bool = False,
    gated: bool = False,
    pdl: bool = False,
    x_words: bool = False,
) -> None:
    """Launches the GEMV on inputs ``kernels.int4_gemm.int4_gemm`` (``int4_gemm_gated``) has checked;
    ``factored`` needs each ``block_k`` tile inside one group (no g_idx, ``group_size % block_k == 0``) and
    falls back to exact. ``gated``: the GEMV of ``silu_and_mul(x)``, K is half of x's columns. ``pdl``: launched
    with programmatic dependent launch where the device has it (``kernels.pdl``). ``x_words``: a factored, not gated
    GEMV of bf16 x loads it as int32 pairs where x allows (``_words_fit``); elsewhere the ``x_words`` request does
    nothing."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = qweight.shape[1]
    block_m = next_pow2(m)
    k_per_split = -(-k // (split_k * block_k)) * block_k  # whole tiles per split
    split = -(-k // k_per_split)
    num_tiles = -(-n // block_n)
    target = split_target(split_reduce, split, num_tiles, block_m * block_n, out)
    one_group = g_idx is None and group_size % block_k == 0
    hopper = pdl_supported(x)
    pdl = pdl and hopper
    factored = factored and one_group
    x_words = x_words and factored and not gated and _words_fit(x, k, block_k)
    _int4_gemv_kernel[(num_tiles, split)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, target.workspace, target.counters,
        m, n, k, k_per_split, 0x3F800000,
        x.stride(0), x.stride(1), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None, FACTORED=factored,
        ONE_GROUP_PER_TILE=one_group, SUBNORMAL=subnormal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        SPLIT_MODE=target.mode, SPLIT_CHUNK=target.chunk, EVEN=n % block_n == 0 and k % block_k == 0, GATED=gated,
        PDL=pdl, TRIGGER=hopper, X_WORDS=x_words, num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def _words_fit(x: torch.Tensor, k: int, block_k: int) -> bool:
    """Whether x can be loaded as int32 pairs of bf16: unit stride along K, rows starting on 4-byte boundaries,
    whole K tiles (no mask along K)."""
    rows_aligned = x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
    return x.dtype == torch.bfloat16 and x.stride(1) == 1 and rows_aligned and k % block_k == 0
