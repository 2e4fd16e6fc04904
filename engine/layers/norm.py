"""RMSNorm with a fused residual add: the Triton kernel on CUDA when it is available, the torch
reference elsewhere (same signature, same float32 maths as HF transformers)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

from kernels.norm import rms_norm_ref


@cache
def _triton_rms_norm() -> Callable[..., Any] | None:
    try:
        from kernels.norm import rms_norm  # type: ignore[attr-defined]
    except ImportError:
        return None
    return rms_norm  # type: ignore[no-any-return]


class RMSNorm(nn.Module):
    """``forward(x)`` -> norm(x); ``forward(x, residual)`` -> (norm(x + residual), x + residual).
    Leading dimensions are flattened, so per-head norms (Qwen3 q/k norm) work on ``[T, heads, D]``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])  # [N, D]
        res2d = None if residual is None else residual.reshape(-1, shape[-1])
        fn = _triton_rms_norm() if x.is_cuda else None
        out = (fn or rms_norm_ref)(x2d, self.weight, self.eps, res2d)
        if residual is None:
            assert isinstance(out, torch.Tensor)
            return out.reshape(shape)
        assert isinstance(out, tuple)
        return out[0].reshape(shape), out[1].reshape(shape)
