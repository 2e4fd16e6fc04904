"""Tensor-parallel linear layers (Megatron split): column-parallel shards the output features, row-parallel
shards the input features and all-reduces its output. Weights keep PyTorch's ``[out, in]`` layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.weights import WeightSource, copy_checked, read_full, set_weight_loader
from engine.parallel import ParallelState, divide


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialised: filled by load_weights, or by the dummy loader. Dtype/device come from the
    # build context (torch default dtype and device set by build_model).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by rows (output features); each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, parallel.world_size, "output features")
        self.weight = _new_param(self.output_size_per_rank, input_size)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(self.output_size_per_rank)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        size = param.shape[0]
        copy_checked(param, source.narrow(0, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up). Each rank's
    output is ``[shard of out 0 | shard of out 1 | ...]``; ``shard_id`` in the loader indexes the parts."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, parallel: ParallelState) -> None:
        self.output_sizes_per_rank = [divide(s, parallel.world_size, "output features") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, parallel)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id (index of the merged projection)")
        size = self.output_sizes_per_rank[shard_id]
        offset = sum(self.output_sizes_per_rank[:shard_id])
        copy_checked(param.data.narrow(0, offset, size), source.narrow(0, self.parallel.rank * size, size))


class QKVParallelLinear(nn.Module):
    """Q, K and V projections in one column-parallel matmul, split by attention head.

    Query heads must divide evenly over ranks. KV heads do too when there are at least as many as ranks;
    with fewer (GQA, e.g. 2 KV heads on 4 ranks) each rank keeps one KV head, replicated across the
    ``world_size / num_kv_heads`` ranks whose query heads use it. Per-rank output: ``[q | k | v]``.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, parallel: ParallelState
    ) -> None:
        super().__init__()
        world = parallel.world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, world, "num_attention_heads")
        if num_kv_heads >= world:
            self.num_kv_heads = divide(num_kv_heads, world, "num_key_value_heads")
            self.kv_head_start = parallel.rank * self.num_kv_heads
        else:
            replicas = divide(world, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = parallel.rank // replicas
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.parallel = parallel
        self.input_size = hidden_size
        self.output_size_per_rank = self.q_size + 2 * self.kv_size
        self.weight = _new_param(self.output_size_per_rank, hidden_size)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(self.output_size_per_rank)
            set_weight_loader(self.bias, self.weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: str | None = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            dst, src_start = param.data.narrow(0, 0, self.q_size), self.parallel.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            dst, src_start = param.data.narrow(0, offset, self.kv_size), self.kv_head_start * d
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(dst, source.narrow(0, src_start, dst.shape[0]))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q_size + 2 kv_size] -> q [T, heads, D], k and v [T, kv_heads, D] (per rank)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        return (
            q.reshape(t, self.num_heads, self.head_dim),  # [T, heads, D]
            k.reshape(t, self.num_kv_heads, self.head_dim),  # [T, kv_heads, D]
            v.reshape(t, self.num_kv_heads, self.head_dim),
        )


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by columns (input features): the input arrives already split (the output
    of a column-parallel layer), partial products are all-reduced, then the (replicated) bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size_per_rank = divide(input_size, parallel.world_size, "input features")
        self.output_size = output_size
        self.weight = _new_param(output_size, self.input_size_per_rank)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(output_size)
            set_weight_loader(self.bias, self.bias_loader)

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        size = param.shape[1]
        copy_checked(param, source.narrow(1, self.parallel.rank * size, size))

    def bias_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        copy_checked(param, read_full(source))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
