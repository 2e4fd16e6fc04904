"""The W4A16 GEMM for mid-size batches (tens to hundreds of rows) on Hopper's wgmma, in Gluon.

``kernels.int4_gemv_mma`` runs mma.sync with x's tile taken to every warp's registers each K tile: its time doubles
with the rows from 16 on (docs/benchmarks.md, Session 25). Here the MMA is Hopper's warpgroup MMA, whose B operand
is read from shared memory by the tensor cores, as wide as the rows (8-256): out^T = W^T x^T with the weights as the A
operand in registers, dequantized there to ``(c - z) s`` exactly as ``kernels.int4_gemv_mma`` does (the same packed
words, lanes and k order: ``mma_position``), and x's tile ``[BLOCK_M, BLOCK_K]`` stored to shared memory in that
k order once per K tile for all the program's warps. One warpgroup a program (64 output features a warpgroup tile,
``BLOCK_N`` a multiple of 64), split-K reduced in the launch by fp32 atomics, as the MMA kernel's.

Not pipelined: each K tile loads, stores x, fences and waits for its MMA; the SM overlaps programs instead (the
grid is filled to a few programs per SM). Two pipelined K loops (each tile's loads a tile ahead; the MMA left
running while the next tile's x is stored and its weights dequantized) lost to this one in every sweep row on the
H200 (Session 33: 1.21-1.30x its time at 64 rows, 1.27-1.36x at 128) and were removed. Gluon does not run under the CPU interpreter: there ``kernels.int4_gemm``
falls back, and the CPU tests compile this kernel for sm_90.
"""

from __future__ import annotations

import torch

from kernels.int4_gemv_mma import BASE, PERMUTE_SPAN, words_layout
from kernels.int4_split import zeroed_scratch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
    )

    from kernels.int4_gemv_mma import _packed_pair, _weight_operand, store_split

    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6 | 3.7
except ImportError:  # pragma: no cover - no Triton, or one without Gluon
    gluon = None

WARPGROUP_ROWS = 64  # output features of one warpgroup MMA tile (4 warps x 16)


def check_tile(block_m: int, block_n: int, block_k: int, group_size: int, num_warps: int) -> None:
    """Raises unless the tile fits the MMA (:func:`int4_gemm_wgmma`'s docstring)."""
    if num_warps not in (4, 8) or block_n % (WARPGROUP_ROWS * num_warps // 4):
        raise ValueError(f"wgmma tile of {block_n} columns, {num_warps} warps: 4 or 8 warps, 64 columns a warpgroup")
    if group_size % block_k or block_k % PERMUTE_SPAN or block_m % 8 or block_m > 256:
        raise ValueError(f"wgmma tile {block_m} x {block_n} x {block_k} does not fit the MMA or the group {group_size}")


def on_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU (the warpgroup MMA is Hopper's only) and Gluon is here."""
    return gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def wgmma_available(x: torch.Tensor, group_size: int, has_g_idx: bool) -> bool:
    """Whether this kernel can run ``x``: Gluon, an sm_90 GPU, bf16/fp16 with unit stride along K, no g_idx, groups
    of multiples of 32 k's. Where it can't, ``kernels.int4_gemm`` runs tl.dot."""
    if not on_hopper(x.device):
        return False
    shape_ok = x.shape[1] <= 1 or x.stride(1) == 1
    return x.dtype in BASE and shape_ok and not has_g_idx and group_size % PERMUTE_SPAN == 0


if gluon is not None:

    @gluon.jit
    def _x_tile(x_ptr, stride_xm, offs_m, M, k0, k_end, BLOCK_K: gl.constexpr, x_layout: gl.constexpr):
        """x's rows ``offs_m`` ``[BM, BLOCK_K]`` from ``k0`` (zeros past M and k_end), its k's in MMA positions."""
        P: gl.constexpr = BLOCK_K // 32
        BM: gl.constexpr = offs_m.shape[0]
        offs_k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
        mask = (offs_m < M)[:, None] & (offs_k < k_end)[None, :]
        x = gl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        # input feature 32p + 8q + 4h + 2 r1 + r0 -> MMA position 32p + 16 r1 + 8 r0 + 2q + h
        t = gl.permute(gl.reshape(x, (BM, P, 4, 2, 2, 2)), (0, 1, 4, 5, 2, 3))  # [BM, P, r1, r0, q, h]
        return gl.reshape(t, (BM, BLOCK_K))

    @gluon.jit
    def _tile_loads(tile, k0, GROUP_SIZE: gl.constexpr, BLOCK_K: gl.constexpr, EVEN_N: gl.constexpr,
                    x_layout: gl.constexpr):  # fmt: skip
        """The K tile at ``k0``'s scales and zeros ``[BN]``, packed words ``[P, 4, BN]`` and x's tile ``[BM, BLOCK_K]``
        in MMA k order (zeros from ``k_end`` on)."""
        x_ptr, qw_ptr, s_ptr, z_ptr, stride_xm, stride_qk, stride_sg, stride_zg, offs_xm, offs_wn, word_rows, w_cols, \
            M, N, k_end = tile  # fmt: skip
        live = k0 < k_end  # true for every tile of the loop; kept so the loop compiles as the sweep measured it
        g = k0 // GROUP_SIZE
        mask_wn = (offs_wn < N) & live
        s = gl.load(s_ptr + g * stride_sg + offs_wn, mask=mask_wn, other=0.0)
        z = gl.load(z_ptr + g * stride_zg + offs_wn, mask=mask_wn, other=0)
        mask_w = ((w_cols < N) | EVEN_N) & live
        words = gl.load(qw_ptr + (k0 // 8 + word_rows) * stride_qk + w_cols, mask=mask_w, other=0)
        return s, z, words, _x_tile(x_ptr, stride_xm, offs_xm, M, k0, k_end, BLOCK_K, x_layout)

    @gluon.jit
    def _a_operand(s, z, words, base_bits, base, a_layout: gl.constexpr, IS_BF16: gl.constexpr):
        """The tile's weights dequantized to ``(c - z) s`` in registers: the MMA's A operand ``[BN, BLOCK_K]``."""
        s2 = _packed_pair(s.to(gl.float32), IS_BF16)
        negz2 = _packed_pair(-(base + z.to(gl.float32)), IS_BF16)
        return _weight_operand(words, base_bits, negz2, s2, a_layout, IS_BF16, True)

    @gluon.jit
    def _tile_mma(acc, x_smem, s, z, words, xt, base_bits, base, a_layout: gl.constexpr, IS_BF16: gl.constexpr):
        """``acc`` plus one K tile: x stored to shared memory, the weights dequantized as the A operand, the MMA."""
        _cta_barrier()  # the last tile's MMA has read x_smem (it was waited for by every warp)
        x_smem.store(xt)
        fence_async_shared()
        _cta_barrier()  # every warp's part of the tile stored before the MMA reads it
        a = _a_operand(s, z, words, base_bits, base, a_layout, IS_BF16)
        return warpgroup_mma(a, x_smem.permute((1, 0)), acc)

    @gluon.jit
    def _int4_gemm_wgmma_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, K_PER_SPLIT, base_bits, base,
        stride_xm, stride_qk, stride_sg, stride_zg, stride_om,
        GROUP_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        SPLIT: gl.constexpr, EVEN_N: gl.constexpr, IS_BF16: gl.constexpr, W_LAYOUT: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """W_LAYOUT: ``kernels.int4_gemv_mma.words_layout``. Program (pid_m, pid_n, pid_k): rows ``pid_m *
        BLOCK_M ..`` of x, output features ``pid_n * BLOCK_N ..`` (64 a warpgroup, ``num_warps // 4`` of them
        sharing x's tile), one K range."""
        P: gl.constexpr = BLOCK_K // 32
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        w_layout: gl.constexpr = W_LAYOUT
        X_LANES_K: gl.constexpr = min(16, BLOCK_K // 8)  # x's tile loaded in 16-byte vectors
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // X_LANES_K, X_LANES_K], [num_warps, 1], [1, 0])
        x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], x_ptr.dtype.element_ty)
        pid_m = gl.program_id(0)  # fastest: the programs that read the same weights run together (L2 hits)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        w2: gl.constexpr = gl.SliceLayout(2, w_layout)
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, w2))
        offs_q = gl.arange(0, 4, layout=gl.SliceLayout(0, w2))
        offs_wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
        word_rows = gl.expand_dims(4 * offs_p[:, None] + offs_q[None, :], 2)  # [P, 4, 1]
        w_cols = gl.expand_dims(gl.expand_dims(offs_wn, 0), 1)  # [1, 1, BN]
        offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        k_start = pid_k * K_PER_SPLIT
        k_end = gl.minimum(k_start + K_PER_SPLIT, K)
        acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=mma)
        tile = (x_ptr, qw_ptr, s_ptr, z_ptr, stride_xm, stride_qk, stride_sg, stride_zg, offs_xm, offs_wn, word_rows,
                w_cols, M, N, k_end)  # fmt: skip
        x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_M, BLOCK_K], x_shared)
        for k0 in range(k_start, k_end, BLOCK_K):
            s, z, words, xt = _tile_loads(tile, k0, GROUP_SIZE, BLOCK_K, EVEN_N, x_layout)
            acc = _tile_mma(acc, x_smem, s, z, words, xt, base_bits, base, a_layout, IS_BF16)
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        store_split(acc, offs_n, offs_m, N, M, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLIT)


def int4_gemm_wgmma(
    x: torch.Tensor,  # [M, K] bf16 or fp16, unit stride along K
    qweight: torch.Tensor,  # [K // 8, N] int32, contiguous along N
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    out: torch.Tensor,  # [M, N] contiguous, x.dtype
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int = 4,
) -> None:
    """Launches on inputs ``kernels.int4_gemm.int4_gemm`` has checked (:func:`wgmma_available`): ``block_m`` a
    multiple of 8 up to 256 (the MMA's N), ``block_n`` of 64 a warpgroup (``num_warps`` 4 or 8), ``block_k`` (a
    multiple of 32) dividing the group."""
    m, k = x.shape
    n = qweight.shape[1]
    if gluon is None:
        raise RuntimeError("the wgmma int4 GEMM needs a Triton with Gluon")
    check_tile(block_m, block_n, block_k, group_size, num_warps)
    base, bits = BASE[x.dtype]
    k_per_split = -(-k // (split_k * block_k)) * block_k
    split = -(-k // k_per_split)
    num_tiles, m_tiles = -(-n // block_n), -(-m // block_m)
    ws = zeroed_scratch(x.device, torch.float32, m * n) if split > 1 else out
    counters = zeroed_scratch(x.device, torch.int32, num_tiles * m_tiles) if split > 1 else out
    _int4_gemm_wgmma_kernel[(m_tiles, num_tiles, split)](
        x, qweight, scales, zeros, out, ws, counters,
        m, n, k, k_per_split, bits, base,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        EVEN_N=n % block_n == 0, IS_BF16=x.dtype == torch.bfloat16,
        W_LAYOUT=words_layout(block_k // PERMUTE_SPAN, block_n, num_warps), num_warps=num_warps,
    )  # fmt: skip
