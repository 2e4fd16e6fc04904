"""Optional Triton import shared by the kernel modules.

``import kernels.x`` must work on API nodes and CPU machines without Triton: there the ``@triton.jit``
decorator becomes a stub, and the public wrappers raise a clear error through ``require_triton``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

triton: Any
tl: Any
try:
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised in a subprocess test
    HAS_TRITON = False

    def _jit_stub(fn: Any = None, **_kwargs: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    triton = SimpleNamespace(jit=_jit_stub)
    tl = SimpleNamespace(constexpr=object)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def require_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            f"{name} needs Triton, which is not installed; install pagedserve[gpu] or use the torch "
            f"reference {name}_ref"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
