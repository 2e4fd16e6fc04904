"""Gated activations: the fused Triton kernel on CUDA when it is available, the torch reference elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

from kernels.activation import silu_and_mul_ref


@cache
def _triton_silu_and_mul() -> Callable[..., Any] | None:
    from kernels._triton import HAS_TRITON

    if not HAS_TRITON:
        return None
    from kernels.activation import silu_and_mul

    return silu_and_mul


class SiluAndMul(nn.Module):
    """[T, 2 * I] (gate | up) -> silu(gate) * up, [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = _triton_silu_and_mul() if x.is_cuda else None
        return (fn or silu_and_mul_ref)(x)
