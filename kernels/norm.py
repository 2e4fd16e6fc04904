"""RMSNorm with an optional fused residual add (the residual stream of a pre-norm transformer)."""

from __future__ import annotations

import torch


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
