"""SiLU-and-multiply of the gated MLP in one pass: ``[T, 2I]`` (gate | up) -> ``silu(gate) * up``, ``[T, I]``.

Unfused, torch reads the gate and writes silu(gate), then reads both halves and writes the product: 5I
elements of traffic per token instead of 3I here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import check_float, require_triton, tl, triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` in x's dtype, rounding as HF transformers' MLP does."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@triton.jit
def silu_mul(gate, up):
    """``silu(gate) * up`` of two tiles of x's dtype in fp32, rounded to x's dtype after the silu and again
    after the product: the two roundings of the torch reference. The one copy of this arithmetic: the
    GEMVs that apply the activation as they load x (``kernels.gemv``, ``kernels.int4_gemv``) call it too."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_ref` for ``x`` of shape ``[..., 2I]``."""
    require_triton("silu_and_mul")
    check_float("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim must be even (gate | up), got {x.shape[-1]}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
    inter = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2d.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2d.shape[0] > 0 and inter > 0:
        block = 1024 if inter >= 1024 else 1 << max(4, (inter - 1).bit_length())
        grid = (x2d.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2d, out, x2d.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4)
    return out.reshape(*x.shape[:-1], inter)
