"""Tensor-parallel process group state, passed explicitly to every layer (no module-level globals).

At ``world_size == 1`` every collective is a no-op, so single-process code pays nothing for TP support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # None = the default (world) group

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks (in place when distributed); returns the summed tensor."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def init_distributed(
    rank: int, world_size: int, init_method: str | None = None, backend: str | None = None, force: bool = False
) -> ParallelState:
    """Join the TP process group (``backend`` None = nccl when CUDA is available, else gloo).
    At world_size 1 no process group is created unless ``force`` (the process-per-rank path at TP=1)."""
    if world_size == 1 and not force:
        return ParallelState()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return ParallelState(rank=rank, world_size=world_size, group=None)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division for shard sizes; a ValueError says which dimension does not split."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
