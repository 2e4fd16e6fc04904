"""How layers receive checkpoint tensors.

A weight loader gets the *full* HF tensor, or anything that can hand out a slice of it (``shape`` plus
``narrow``), and copies the rank's part into its parameter. ``torch.Tensor`` already fits; the safetensors
loader passes a lazy slice so that each rank reads only its own bytes from disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class WeightSource(Protocol):
    @property
    def shape(self) -> Sequence[int]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class LinearSlice:
    """The part of a checkpoint weight ``[out, in]`` (HF's layout) that one rank's linear layer holds: rows
    ``out_start : out_start + out_size`` and columns ``in_start : in_start + in_size``, landing at
    ``dst_offset`` of the layer's output features (merged projections hold several)."""

    dst_offset: int
    out_start: int
    out_size: int
    in_start: int
    in_size: int


WeightLoader = Callable[..., None]  # (param, source[, shard_id]) -> None


def read_full(source: WeightSource) -> torch.Tensor:
    return source.narrow(0, 0, source.shape[0])


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch loading {name or 'parameter'}: expected {tuple(param.shape)}, got {tuple(loaded.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded)


def default_weight_loader(param: torch.nn.Parameter, source: WeightSource) -> None:
    """Replicated parameters (norms, biases of row-parallel layers): every rank takes the whole tensor."""
    copy_checked(param, read_full(source))


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: torch.nn.Parameter) -> Any:
    return getattr(param, "weight_loader", default_weight_loader)
