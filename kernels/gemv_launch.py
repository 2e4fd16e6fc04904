"""Host-side helpers of ``kernels.gemv``'s launches: the input checks and the per-device scratch that every
launch leaves at zero (split-K arrival counters, the atomic accumulator)."""

from __future__ import annotations

import torch

_ZEROED: dict[tuple[str, int | None, torch.dtype], list[torch.Tensor]] = {}


def zeroed_buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """At least ``numel`` zeros that every GEMV launch leaves zero (split-K counters, the atomic
    accumulator). Grown on demand and never freed, as a captured CUDA graph keeps the address of the one it
    was captured with; growing inside a capture is refused (the zeroing would only be recorded, not run):
    run each shape once before capturing it, as the engine's decode graphs do."""
    bufs = _ZEROED.setdefault((device.type, device.index, dtype), [])
    if not bufs or bufs[-1].numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv split-K: run this shape once before capturing it in a CUDA graph")
        bufs.append(torch.zeros(max(numel, 2 * bufs[-1].numel() if bufs else 1 << 14), dtype=dtype, device=device))
    return bufs[-1]


def scratch_is_zero() -> bool:
    """Whether every counter and accumulator is back at zero (tests and the benchmark check it)."""
    return all(not buf.any() for bufs in _ZEROED.values() for buf in bufs)


def check_gemv_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> None:
    """``gated``: x is ``x2 [M, 2K]`` (gate | up)."""
    fn, xn, xk = ("gemv_gated", "x2", "2K") if gated else ("gemv", "x", "K")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{fn}: {xn} must be float16 or bfloat16, got {x.dtype}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{fn}: weight and bias must have {xn}'s dtype {x.dtype}, got {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != (2 if gated else 1) * weight.shape[1]:
        raise ValueError(f"{fn}: {xn} [M, {xk}] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{fn}: bias must be [N={weight.shape[0]}], got {tuple(bias.shape)}")
    if (x.shape[1] > 1 and x.stride(1) != 1) or (weight.shape[1] > 1 and weight.stride(1) != 1):
        raise ValueError(f"{fn}: {xn} and weight must be contiguous along K, got {x.stride()}, {weight.stride()}")
    if bias is not None and weight.shape[0] > 1 and bias.stride(0) != 1:
        raise ValueError(f"{fn}: bias must be contiguous, got stride {bias.stride()}")
    devices = {x.device, weight.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        raise ValueError(f"{fn}: all tensors must be on one device, got {devices}")
