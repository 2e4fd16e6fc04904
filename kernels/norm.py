"""RMSNorm with an optional fused residual add (the residual stream of a pre-norm transformer)."""

from __future__ import annotations

import os

import torch

from kernels._triton import check_float, next_pow2, require_triton, tl, triton
from kernels.pdl import PDL_MAX_ROWS, launch_dependents, pdl_supported, wait_prior_grids

_MAX_HIDDEN = 65536  # one program holds a whole row in registers
# Launched with programmatic dependent launch on sm_90+ (kernels.pdl) for kernels.pdl.PDL_MAX_ROWS rows: the weight
# is loaded while the kernel before finishes (the int4 GEMVs let it start during their split-K reduction). H200,
# batch-1 TPOT: int4, kernels.int4_plan.GEMV_PDL says; bf16 8B with the decode kernels 4.163 ms against 4.175 off
# (loadtest.throughput latency, 895de8b), 4.180 against 4.181-4.186 (int4_bench, caa17d7).
# PAGEDSERVE_NORM_PDL=0 turns it off.
RMS_NORM_PDL = os.environ.get("PAGEDSERVE_NORM_PDL", "1") != "0"


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without ``residual``: norm(x) * weight. With it: returns (norm(x + residual) * weight, x + residual).
    Computed in float32 and cast back, as HF transformers does, so greedy outputs match it."""
    if residual is not None:
        x = residual + x
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, TRIGGER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if TRIGGER:  # a PDL-launched next kernel (the int4 GEMV) may start loading its weights (kernels.pdl)
        launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    # the weight is loaded first: issued after the reduction's barriers, its load would add a memory round trip
    # to a kernel whose M = 1 call (a decode step at batch 1, 65 calls) is all latency
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:  # the weight is nobody's output; x and the residual are the kernel before's
        wait_prior_grids()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # round the sum to the input dtype before the norm, as the reference (and HF) does
        x = x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    y = (h * inv_rms).to(x.dtype).to(tl.float32)  # the reference casts back before the weight multiply
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rms_norm_ref` (one fused pass: residual add, norm, weight)."""
    require_triton("rms_norm")
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} exceeds the kernel's limit {_MAX_HIDDEN}")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}"
            )
        tensors["residual"] = residual
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)  # as ``weight * h.to(dtype)`` in the reference
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_tokens > 0:
        res_in = residual if residual is not None else x
        hopper = pdl_supported(x)
        pdl = hopper and RMS_NORM_PDL and num_tokens <= PDL_MAX_ROWS
        _rms_norm_kernel[(num_tokens,)](
            x, res_in, weight, out, residual_out, eps,
            x.stride(0), res_in.stride(0), out.stride(0), residual_out.stride(0),
            HIDDEN=hidden, BLOCK=next_pow2(hidden), HAS_RESIDUAL=residual is not None, TRIGGER=hopper,
            PDL=pdl, num_warps=min(16, max(1, next_pow2(hidden) // 256)), **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return out if residual is None else (out, residual_out)
