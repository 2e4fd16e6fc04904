"""A second decode GEMV of the W4A16 GEMM (``kernels.int4_gemm``'s ``kernel="gemv_cols"``): each thread owns
whole output columns, so nothing is reduced across threads and nothing goes through shared memory.

Why (sm_90 SASS of ``kernels.int4_gemv``'s GEMV at M = 1, block_n 256, block_k 64): its loop spends ~5.2
instructions per weight, and only 3 of them are the unpack-and-FMA (shift, and-or, FFMA). Triton lays the
``[M, BLOCK_K / 8, BLOCK_N]`` products out with a tile's 8 word rows in each thread and 2 columns per thread,
so every thread converts and sums all 64 activations of a tile for 2 columns (0.9 instructions per weight),
and the words reach that layout through shared memory (cp.async, ldmatrix, barriers). Here a program loads
one packed row ``[BLOCK_N]`` at a time (``[1, BLOCK_N]``: 4 contiguous words per thread, 32 threads, the
warps side by side along N) and multiplies it by the activations of its 8 input features, loaded as
``[BLOCK_M, 1]`` columns that every thread holds whole; with ``BLOCK_N = 1024`` and 4 warps a thread has 8
columns. Shared memory holds only the next tile's words (the prefetch of ``NUM_STAGES = 2``).

The arithmetic is ``kernels.int4_gemv``'s factored form (one group per ``8 * ROWS`` tile: ``s (16 sum t -
(16 + z) sum x)`` with ``t = (1 + c / 16) x``), so g_idx and groups narrower than a tile stay on that GEMV;
with ``PAIRED`` one shift places two nibbles at once, the even one as ``1 + c / 256`` summed apart
(:func:`_nibble_pair`). The loop then compiles to ~3.2 instructions per weight at M = 1 (64 registers;
3.6 unpaired), against ~5.2 for ``kernels.int4_gemv``; pairing keeps 4 fewer bits of each even nibble's
product below the carrier (relative error ~1e-6 at K = 4096-14336 in fp32, against the old GEMV's ~5e-7 and
bf16 output rounding's ~2e-3).

Weights: the loader's ``[K // 8, N]`` or the GEMV-tiled ``[N / BLOCK_N, K // 8, BLOCK_N]`` of
:func:`tile_qweight`, where a program's words are one contiguous run (``K_PER_SPLIT / 2`` bytes per column
tile) instead of ``BLOCK_N * 4``-byte pieces ``N * 4`` bytes apart. Whether that helps HBM is what
``loadtest.int4_gemm_sweep`` measures; the engine keeps the loader's layout (the tl.dot path and the
dequantization read it).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, tl, triton
from kernels.int4_gemv import nibble
from kernels.int4_split import finish_tile, split_target


@triton.jit
def _x_column(x_ptr, offs_m, k, stride_xm, stride_xk, M, BLOCK_M: tl.constexpr):
    """``x[:, k]`` as fp32 ``[BLOCK_M, 1]``, zero past M; ``BLOCK_M == 1`` means M == 1: no mask."""
    ptrs = x_ptr + offs_m[:, None] * stride_xm + k * stride_xk
    if BLOCK_M == 1:
        return tl.load(ptrs).to(tl.float32)
    return tl.load(ptrs, mask=(offs_m < M)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _nibble_pair(words, P: tl.constexpr, one_bits):
    """Nibbles ``2P`` and ``2P + 1`` of every word as fp32 ``1 + c / 256`` and ``1 + c / 16`` from one shift:
    the word moved so that they sit at bits 15..18 and 19..22 (the top of the mantissa), each and-or-ed with
    1.0's bits (one LOP3 each) -- half the shifts of ``kernels.int4_gemv.nibble``, one per nibble."""
    bits = (words << (15 - 8 * P)) if 8 * P <= 15 else (words >> (8 * P - 15))
    lo = ((bits & 0x78000) | one_bits).to(tl.float32, bitcast=True)
    hi = ((bits & 0x780000) | one_bits).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _row_sums(t_lo, t_hi, xs_lo, xs_hi, words, x_ptr, offs_m, k, stride_xm, stride_xk, M, one_bits, BLOCK_M: tl.constexpr, PAIRED: tl.constexpr):  # fmt: skip
    """Adds one word row (input features ``k .. k + 7``) to the tile's sums ``[BM, BN]`` and ``[BM, 1]``.
    Paired: even nibbles (``1 + c / 256``) into ``t_lo``/``xs_lo``, odd ones (``1 + c / 16``) into ``t_hi``/
    ``xs_hi``; unpaired: every nibble ``1 + c / 16`` into ``t_hi``/``xs_hi``."""
    for p in tl.static_range(4):
        x_even = _x_column(x_ptr, offs_m, k + 2 * p, stride_xm, stride_xk, M, BLOCK_M)
        x_odd = _x_column(x_ptr, offs_m, k + 2 * p + 1, stride_xm, stride_xk, M, BLOCK_M)
        if PAIRED:
            lo, hi = _nibble_pair(words, p, one_bits)
            t_lo += lo * x_even
            xs_lo += x_even
        else:
            t_hi += nibble(words, 2 * p, one_bits) * x_even
            xs_hi += x_even
            hi = nibble(words, 2 * p + 1, one_bits)
        t_hi += hi * x_odd
        xs_hi += x_odd
    return t_lo, t_hi, xs_lo, xs_hi


@triton.jit
def _load_n(ptrs, mask, EVEN_N: tl.constexpr):
    if EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit(do_not_specialize=["M"])  # one compile for every M of a block_m
def _int4_gemv_cols_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, one_bits,
    stride_xm, stride_xk, stride_qk, stride_qtile, stride_sg, stride_zg, stride_om,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    NUM_STAGES: tl.constexpr, SPLIT_MODE: tl.constexpr, SPLIT_CHUNK: tl.constexpr, EVEN_N: tl.constexpr,
    PAIRED: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + offs_c
    mask_n = (offs_n < N)[None, :]
    # word (row i, column n) at qw + (n // BLOCK_N) * stride_qtile + i * stride_qk + n % BLOCK_N: the loader's
    # layout is stride_qtile = BLOCK_N, stride_qk = N; the tiled one K // 8 * BLOCK_N and BLOCK_N
    qw_tile = qw_ptr + pid_n * stride_qtile + offs_c[None, :]  # [1, BN]
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)  # K_PER_SPLIT and K are multiples of 8 * ROWS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, 8 * ROWS, num_stages=NUM_STAGES):
        t_lo = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # sum over even k of (1 + c_k / 256) x_k
        t_hi = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # sum over odd k (all k unpaired) of (1 + c_k / 16) x_k
        xs_lo = tl.zeros((BLOCK_M, 1), dtype=tl.float32)  # sum of the x_k in t_lo
        xs_hi = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
        for i in tl.static_range(ROWS):
            words = _load_n(qw_tile + (k0 // 8 + i) * stride_qk, mask_n, EVEN_N)  # [1, BN] int32
            t_lo, t_hi, xs_lo, xs_hi = _row_sums(
                t_lo, t_hi, xs_lo, xs_hi, words, x_ptr, offs_m, k0 + 8 * i, stride_xm, stride_xk, M, one_bits,
                BLOCK_M, PAIRED,
            )  # fmt: skip
        g = k0 // GROUP_SIZE  # the tile lies inside one group
        s = _load_n(s_ptr + g * stride_sg + offs_n[None, :], mask_n, EVEN_N).to(tl.float32)
        z = _load_n(z_ptr + g * stride_zg + offs_n[None, :], mask_n, EVEN_N).to(tl.float32)
        # sum_k (c_k - z) x_k = 256 (t_lo - xs_lo) + 16 (t_hi - xs_hi) - z (xs_lo + xs_hi); the x sums are
        # per row, shared by the columns: 4 operations per column and tile
        carrier = 256.0 * xs_lo + 16.0 * xs_hi  # [BM, 1]
        acc += s * ((256.0 * t_lo + 16.0 * t_hi) - (carrier + z * (xs_lo + xs_hi)))
    finish_tile(
        acc, out_ptr, ws_ptr, cnt_ptr, out_ptr, ws_ptr, offs_m, offs_n, M, N, stride_om, 0, pid_n, 0, pid_k,
        tl.num_programs(1), SPLIT_MODE, SPLIT_CHUNK, False,
    )  # fmt: skip


def tile_qweight(qweight: torch.Tensor, block_n: int) -> torch.Tensor:
    """``[K // 8, N]`` -> ``[ceil(N / block_n), K // 8, block_n]`` contiguous (columns past N zero): each
    column tile's words in one run, K-major. Same bytes as the loader's layout plus the padding of N."""
    rows, n = qweight.shape
    tiles = -(-n // block_n)
    padded = qweight.new_zeros((rows, tiles * block_n))
    padded[:, :n] = qweight
    return padded.view(rows, tiles, block_n).permute(1, 0, 2).contiguous()


def int4_gemv_cols_launch(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K // 8, N] int32, contiguous along N, or tile_qweight's [tiles, K // 8, block_n]
    scales: torch.Tensor,  # [num_groups, N], contiguous along N
    zeros: torch.Tensor,  # [num_groups, N] uint8, contiguous along N
    group_size: int,
    out: torch.Tensor,  # [M, N] contiguous, x.dtype
    *,
    block_n: int,
    rows: int,
    split_k: int,
    split_reduce: str,
    num_warps: int,
    num_stages: int,
    paired: bool = True,
) -> None:
    """Launches on inputs ``kernels.int4_gemm.int4_gemm`` has checked; needs ``group_size % (8 * rows) == 0``
    (every tile inside one group) and, for a tiled weight, ``block_n`` its tile width."""
    m, k = x.shape
    n = out.shape[1]
    block_k = 8 * rows
    if group_size % block_k or k % block_k:
        raise ValueError(f"gemv_cols needs 8 * rows ({block_k}) to divide group_size ({group_size}) and K ({k})")
    if qweight.dim() == 3:
        if qweight.shape[2] != block_n or not qweight.is_contiguous():
            raise ValueError(f"tiled qweight {tuple(qweight.shape)} must be contiguous with tiles of {block_n}")
        stride_qk, stride_qtile = block_n, qweight.stride(0)
    else:
        stride_qk, stride_qtile = qweight.stride(0), block_n
    k_tiles = k // block_k
    k_per_split = -(-k_tiles // split_k) * block_k  # whole tiles per split
    split = -(-k // k_per_split)
    num_tiles = -(-n // block_n)
    target = split_target(split_reduce, split, num_tiles, next_pow2(m) * block_n, out)
    _int4_gemv_cols_kernel[(num_tiles, split)](
        x, qweight, scales, zeros, out, target.workspace, target.counters,
        m, n, k, k_per_split, 0x3F800000,
        x.stride(0), x.stride(1), stride_qk, stride_qtile, scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=next_pow2(m), BLOCK_N=block_n, ROWS=rows, NUM_STAGES=num_stages,
        SPLIT_MODE=target.mode, SPLIT_CHUNK=target.chunk, EVEN_N=n % block_n == 0, PAIRED=paired,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
