"""W4A16 GEMM: ``y = x @ dequant(W)^T`` with 4-bit weights dequantized in registers.

One weight layout for every checkpoint format (the loader repacks AWQ, GPTQ and compressed-tensors into it,
bits only, nothing dequantized):

- ``qweight`` int32 ``[K // 8, N]``: nibble ``j`` (bits ``4j .. 4j + 3``) of ``qweight[i, n]`` is the code of
  input feature ``k = 8 i + j`` (GPTQ's layout: a K-tile's codes are contiguous along N, so loads coalesce);
- ``scales`` float ``[num_groups, N]``, ``zeros`` uint8 ``[num_groups, N]`` (codes 0..15; 8 for symmetric);
- group of input feature ``k``: ``k // group_size``, or ``g_idx[k]`` (GPTQ act-order) when given.

``w[n, k] = (code[k, n] - zeros[g(k), n]) * scales[g(k), n]``, computed in the scales' dtype, as
compressed-tensors, AutoAWQ and AutoGPTQ dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from kernels._triton import check_float, require_triton, tl, triton

PACK = 8  # 4-bit codes per int32
_SHIFTS = tuple(range(0, 32, 4))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[K, N]`` (0..15, any int dtype) -> ``qweight`` int32 ``[K // 8, N]`` (layout above)."""
    k, n = codes.shape
    if k % PACK:
        raise ValueError(f"input features ({k}) must be a multiple of {PACK} to pack 4-bit codes")
    c = codes.to(torch.int64).reshape(k // PACK, PACK, n)  # [K/8, 8, N]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=codes.device)
    words = (c << shifts[None, :, None]).sum(dim=1)  # [K/8, N] in 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` int32 ``[K // 8, N]`` -> codes uint8 ``[K, N]``."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)
    codes = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return codes.reshape(-1, qweight.shape[1]).to(torch.uint8)


def dequantize_int4(
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
) -> torch.Tensor:
    """The dense weight ``[N, K]`` (contiguous, PyTorch's Linear layout) in ``scales.dtype``."""
    codes = unpack_int4(qweight).t().contiguous()  # [N, K]
    k = codes.shape[1]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=codes.device) // group_size  # [K]
    z = zeros.t()[:, groups]  # [N, K]
    s = scales.t()[:, groups]  # [N, K]
    return (codes.to(torch.int16) - z.to(torch.int16)).to(scales.dtype) * s


def int4_gemm_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
) -> torch.Tensor:
    """Dequantize, then ``F.linear`` with the ``[N, K]`` weight: bit for bit what a model holding the
    dequantized weight computes (HF transformers' compressed-tensors load does exactly that)."""
    w = dequantize_int4(qweight, scales, zeros, group_size, g_idx)
    return F.linear(x, w.to(x.dtype))


# ---- Triton ----


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, UNPACK_IN_REGISTERS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # [BM, BK]  # fmt: skip
        mask_w = mask_k[:, None] & mask_n[None, :]
        if UNPACK_IN_REGISTERS:  # load each int32 once, replicate it to its 8 rows in registers
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            mask_words = (offs_w * 8 < k_end)[:, None] & mask_n[None, :]
            words = tl.load(
                qw_ptr + offs_w[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_words, other=0
            )
            packed = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:  # each int32 is read by its 8 rows of the tile (cache hits)
            packed = tl.load(
                qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_w, other=0
            )
        codes = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF  # [BK, BN] int32: nibble k % 8 is row k's code
        if HAS_G_IDX:
            g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask_w, other=0.0)
            z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=mask_w, other=0)
        elif ONE_GROUP_PER_TILE:
            g0 = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g0 * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
            z = tl.load(z_ptr + g0 * stride_zg + offs_n * stride_zn, mask=mask_n, other=0)[None, :]
        else:
            g = offs_k // GROUP_SIZE
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask_w, other=0.0)
            z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=mask_w, other=0)
        # (code - zero) * scale rounded once to the scales' dtype, as the reference computes it: exact in
        # fp32 for half scales (5-bit int times 8/11-bit mantissa), fp32's own rounding for fp32 scales
        w = ((codes - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)).to(s.dtype)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Int4GemmConfig:
    """Tile sizes and split-K of one launch; ``None`` fields are picked by :func:`pick_config`."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # load each packed word once and replicate it in registers, instead of once per row (8 loads that hit
    # the cache); off by default until measured on the GPU (loadtest/int4_bench.py has it as a variant)
    unpack_in_registers: bool = False


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 8  # interpreter on CPU: any small number
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def pick_config(m: int, n: int, k: int, group_size: int, num_sms: int, user: Int4GemmConfig) -> Int4GemmConfig:
    """Decode (M <= 16): a 16-row tile (tl.dot's minimum) and split-K until there are ~2 programs per SM,
    as the work is reading the weight once; up to M = 256 split-K still fills the SMs; prefill: big tiles,
    no split (compute bound). From one H200 run (loadtest/int4_bench.py, 8B shapes): block_k 64 beat 128 by
    ~20 % at M <= 16, and split-K 4 halved down_proj at M = 256."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 64, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 32 if m <= 32 else 64, 64, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 128 if m >= 128 else 64, 128, 64, 8, 3
    bm, bn, bk = user.block_m or bm, user.block_n or bn, user.block_k or bk
    if group_size < bk and group_size >= 16 and group_size & (group_size - 1) == 0:
        bk = group_size  # one scale row per tile
    split = user.split_k
    if split is None:
        tiles = -(-m // bm) * -(-n // bn)
        k_tiles = -(-k // bk)
        split = 1
        if m <= 256:
            while tiles * split < 2 * num_sms and split * 2 <= k_tiles and split < 16:
                split *= 2
    return Int4GemmConfig(
        bm, bn, bk, split, user.num_warps or warps, user.num_stages or stages, user.unpack_in_registers
    )


def _check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
) -> None:
    check_float("x", x)
    check_float("scales", scales)
    if x.dim() != 2 or qweight.dim() != 2 or scales.dim() != 2 or zeros.dim() != 2:
        raise ValueError("x [M, K], qweight [K // 8, N], scales and zeros [num_groups, N] must all be 2-D")
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape[0] * PACK != k:
        raise ValueError(
            f"qweight must be int32 [{k // PACK}, N] for K={k}, got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be uint8 codes, got {zeros.dtype}")
    if scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must both be [num_groups, {n}]")
    if g_idx is None:
        if group_size < 1 or k % group_size or scales.shape[0] != k // group_size:
            raise ValueError(f"group_size {group_size} must divide K={k} into scales.shape[0]={scales.shape[0]} groups")
    elif g_idx.dtype != torch.int32 or g_idx.shape != (k,):
        raise ValueError(f"g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous along N, got strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def int4_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    config: Int4GemmConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`int4_gemm_ref`; ``[M, N]`` in ``x.dtype`` (fp32 accumulation)."""
    require_triton("int4_gemm")
    _check_inputs(x, qweight, scales, zeros, group_size, g_idx)
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    device_index = x.device.index if x.device.type == "cuda" and x.device.index is not None else 0
    cfg = pick_config(m, n, k, group_size, _num_sms(device_index), config or Int4GemmConfig())
    assert cfg.block_m and cfg.block_n and cfg.block_k and cfg.split_k  # filled by pick_config
    k_per_split = -(-k // (cfg.split_k * cfg.block_k)) * cfg.block_k  # whole tiles per split
    split = -(-k // k_per_split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16  # see kernels.paged_attention._upcast
    one_group = g_idx is None and group_size % cfg.block_k == 0  # tiles start at multiples of block_k
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n), split)
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, target,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1),
        target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1),
        GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None, ONE_GROUP_PER_TILE=one_group,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        UPCAST=upcast, DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        UNPACK_IN_REGISTERS=cfg.unpack_in_registers,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        out.copy_(target.sum(dim=0))
    return out
