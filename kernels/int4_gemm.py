"""W4A16 GEMM: ``y = x @ dequant(W)^T`` with 4-bit weights dequantized in registers.

The weight layout (``qweight`` int32 ``[K // 8, N]``, ``scales``/``zeros`` ``[num_groups, N]``, optional
``g_idx``) and its dequantization are ``kernels.int4_dequant``'s; so is the large-M path (dequantize once,
then cuBLAS), which the linear layer takes from ``DEQUANT_MIN_M`` rows on. This module is the fused GEMM:
the GEMV (``kernels.int4_gemv``) for a few rows and the tl.dot path below;
``kernels.int4_plan`` picks the kernel and its launch for a shape. ``int4_gemm_gated`` is the MLP's down
projection of gate_up's output ``x2 [M, 2K]``: the GEMV applies ``silu_and_mul`` as it loads x.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from kernels._triton import check_float, require_triton, tl, triton
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.int4_config import Int4GemmConfig, Int4Launch, Kernel
from kernels.int4_dequant import MAGIC_BITS, PACK, check_int4_weights, codes_tile, dequant_tile, dequantize_int4
from kernels.int4_gemm_wgmma import int4_gemm_wgmma, wgmma_available
from kernels.int4_gemv import int4_gemv_launch
from kernels.int4_gemv_mma import gemv_mma_available, int4_gemv_mma
from kernels.int4_gemv_stream import int4_gemv_stream_launch
from kernels.int4_plan import GEMV_MAX_M, num_sms, pick_config
from kernels.int4_split import finish_tile, split_target


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


def int4_gemm_gated_ref(
    x2: torch.Tensor,  # [M, 2K]: gate | up
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
) -> torch.Tensor:
    """``int4_gemm_ref(silu_and_mul_ref(x2), ...)``: the activation rounded to x2's dtype, then the GEMM."""
    return int4_gemm_ref(silu_and_mul_ref(x2), qweight, scales, zeros, group_size, g_idx)


# ---- Triton: the tl.dot path (M above the GEMV's; the GEMV is kernels.int4_gemv) ----


@triton.jit(do_not_specialize=["M"])  # one compile per tile for every M (M = 1 would be its own)
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, magic,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_om,
    GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, UNPACK_IN_REGISTERS: tl.constexpr,
    SPLIT_MODE: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
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
        fields, p = codes_tile(qw_ptr, k0, k_end, offs_k, offs_n, mask_n, stride_qk, stride_qn, UNPACK_IN_REGISTERS)
        mask_w = mask_k[:, None] & mask_n[None, :]
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
        w = dequant_tile(fields, p, z, s, magic).to(s.dtype)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    tile = pid_m * tl.num_programs(1) + pid_n
    finish_tile(
        acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, tile, pid_k, tl.num_programs(2), SPLIT_MODE,
        SPLIT_CHUNK,
    )  # fmt: skip


def _check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
) -> None:
    check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got {tuple(x.shape)}")
    check_int4_weights(qweight, scales, zeros, group_size, g_idx)
    k = x.shape[1]
    if qweight.shape[0] * PACK != k:
        raise ValueError(f"qweight must be int32 [{k // PACK}, N] for K={k}, got {tuple(qweight.shape)}")
    if qweight.device != x.device:
        raise ValueError(f"the weights are on {qweight.device}, x on {x.device}")


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
    m, n = x.shape[0], scales.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = _pick(x, qweight, scales, group_size, g_idx, config)
    if cfg.kernel == "mma" and gemv_mma_available(x, group_size, g_idx is not None):
        int4_gemv_mma(
            x, qweight, scales, zeros, group_size, out,
            block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k, num_warps=cfg.num_warps,
            block_m=cfg.block_m, dequant=not cfg.factored, pdl=cfg.pdl,
        )  # fmt: skip
    elif cfg.kernel == "wgmma" and wgmma_available(x, group_size, g_idx is not None):
        int4_gemm_wgmma(
            x, qweight, scales, zeros, group_size, out,
            block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    elif cfg.kernel in ("mma", "wgmma"):  # no Gluon or no Hopper here (the CPU interpreter): what runs without it
        fallback: Kernel = "gemv" if m <= GEMV_MAX_M else "dot"
        user = replace(
            config or Int4GemmConfig(), kernel=fallback, block_m=None, block_n=None, block_k=None, num_warps=None,
            factored=None,
        )  # fmt: skip
        return int4_gemm(x, qweight, scales, zeros, group_size, g_idx, user)
    elif cfg.kernel == "gemv":
        _launch_gemv(x, qweight, scales, zeros, group_size, g_idx, out, cfg, gated=False)
    else:
        _launch_dot(x, qweight, scales, zeros, group_size, g_idx, out, cfg)
    return out


def int4_gemm_gated(
    x2: torch.Tensor,  # [M, 2K]: gate | up, as the MLP's gate_up projection writes them
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [num_groups, N]
    zeros: torch.Tensor,  # [num_groups, N] uint8
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    config: Int4GemmConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`int4_gemm_gated_ref`: ``int4_gemm(silu_and_mul(x2), ...)``. Where the launch
    is the GEMV its programs compute the activation of the x they load (so the ``[M, K]`` activation is never
    written); another kernel (tl.dot) gets the activation from its own launch first."""
    require_triton("int4_gemm_gated")
    check_float("x2", x2)
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be int32 [K // {PACK}, N], got {tuple(qweight.shape)}")
    k = qweight.shape[-2] * PACK
    if x2.dim() != 2 or x2.shape[1] != 2 * k:
        raise ValueError(f"x2 must be [M, 2K] = [M, {2 * k}] (gate | up) for qweight's K={k}, got {tuple(x2.shape)}")
    gate = x2[:, :k]  # [M, K]: what the checks and the launch choice see
    _check_inputs(gate, qweight, scales, zeros, group_size, g_idx)
    m, n = x2.shape[0], scales.shape[1]
    cfg = _pick(gate, qweight, scales, group_size, g_idx, config) if m and n else None
    if cfg is not None and cfg.kernel != "gemv":
        # the Triton activation needs unit stride along K (the reference takes any)
        act = silu_and_mul(x2) if x2.is_cuda and x2.stride(1) == 1 else silu_and_mul_ref(x2)
        return int4_gemm(act, qweight, scales, zeros, group_size, g_idx, config)
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if cfg is not None:
        _launch_gemv(x2, qweight, scales, zeros, group_size, g_idx, out, cfg, gated=True)
    return out


def _pick(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
    config: Int4GemmConfig | None,
) -> Int4Launch:
    """``pick_config`` for ``x [M, K]`` (M, N >= 1) on x's device."""
    device_index = x.device.index if x.device.type == "cuda" and x.device.index is not None else 0
    user = config or Int4GemmConfig()
    m, k = x.shape
    return pick_config(m, scales.shape[1], k, group_size, num_sms(device_index), user, g_idx is not None)


def _launch_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
    out: torch.Tensor,
    cfg: Int4Launch,
    gated: bool,
) -> None:
    if cfg.stream_programs:
        int4_gemv_stream_launch(
            x, qweight, scales, zeros, group_size, out,
            block_n=cfg.block_n, block_k=cfg.block_k, programs=cfg.stream_programs, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, subnormal=cfg.subnormal, gated=gated, pdl=cfg.pdl, x_words=cfg.x_words,
        )  # fmt: skip
        return
    int4_gemv_launch(
        x, qweight, scales, zeros, group_size, g_idx, out,
        block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k, split_reduce=cfg.split_reduce,
        factored=cfg.factored, num_warps=cfg.num_warps, num_stages=cfg.num_stages, subnormal=cfg.subnormal,
        gated=gated, pdl=cfg.pdl, x_words=cfg.x_words,
    )  # fmt: skip


def _launch_dot(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
    out: torch.Tensor,
    cfg: Int4Launch,
) -> None:
    m, k = x.shape
    n = qweight.shape[1]
    k_per_split = -(-k // (cfg.split_k * cfg.block_k)) * cfg.block_k  # whole tiles per split
    split = -(-k // k_per_split)
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n), split)
    target = split_target(cfg.split_reduce, split, grid[0] * grid[1], cfg.block_m * cfg.block_n, out)
    upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16  # see kernels.attention_launch._upcast
    one_group = g_idx is None and group_size % cfg.block_k == 0  # tiles start at multiples of block_k
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out, target.workspace, target.counters,
        m, n, k, k_per_split, MAGIC_BITS,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1), out.stride(0),
        GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None, ONE_GROUP_PER_TILE=one_group,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        UPCAST=upcast, DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        UNPACK_IN_REGISTERS=cfg.unpack_in_registers,
        SPLIT_MODE=target.mode, SPLIT_CHUNK=target.chunk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
