"""Tensor-parallel linear layers (Megatron split): column-parallel shards the output features, row-parallel
shards the input features and all-reduces its output. Dense weights keep PyTorch's ``[out, in]`` layout.

Each layer says which slice of a checkpoint weight its rank holds (``LinearSlice``: output rows for the
column-parallel ones, input columns for the row-parallel one) and a ``QuantMethod`` (4-bit weights,
``engine.quantization``) may replace the dense ``weight``: it then owns the parameters, their loading from
that slice and the matmul. Biases stay dense.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from engine.layers.norm import RMSNorm
from engine.layers.weights import LinearSlice, WeightSource, copy_checked, read_full, set_weight_loader
from engine.parallel import ParallelState, divide
from kernels.fused_norm import NormIn, materialize, residual_sum_ref
from kernels.gemv import linear as dense_linear
from kernels.gemv import linear_gated as dense_linear_gated
from kernels.gemv import linear_normed as dense_linear_normed
from kernels.gemv import linear_residual as dense_linear_residual
from kernels.gemv import takes_gemv


class QuantMethod(Protocol):
    def create_weights(
        self, layer: Any, input_size: int, output_size: int, loader: Any, is_row_parallel: bool
    ) -> None: ...

    def load(self, layer: Any, param: nn.Parameter, source: WeightSource, sl: LinearSlice) -> None: ...

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class GatedQuantMethod(QuantMethod, Protocol):
    """A ``QuantMethod`` whose matmul can take the gated MLP's ``x2 = gate | up`` and its activation itself
    (``apply(layer, act(x2))``, possibly without the activation launch)."""

    def apply_gated(
        self, layer: Any, x2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor: ...


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialised: filled by load_weights, or by the dummy loader. Dtype/device come from the
    # build context (torch default dtype and device set by build_model).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _read_slice(source: WeightSource, sl: LinearSlice) -> torch.Tensor:
    """``source[out rows, in columns]``, narrowing the partial dimension on disk (lazy slices)."""
    if sl.in_start == 0 and sl.in_size == source.shape[1]:
        return source.narrow(0, sl.out_start, sl.out_size)
    return source.narrow(1, sl.in_start, sl.in_size).narrow(0, sl.out_start, sl.out_size)


class _ParallelLinear(nn.Module):
    """The weight (dense or quantized) of ``[input_size, output_size]`` per rank, plus an optional bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        parallel: ParallelState,
        quant: QuantMethod | None,
        is_row_parallel: bool,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.quant = quant
        self.weight: nn.Parameter | None = None
        if quant is None:
            self.weight = _new_param(output_size, input_size)
            set_weight_loader(self.weight, self.weight_loader)
        else:
            quant.create_weights(self, input_size, output_size, self.weight_loader, is_row_parallel)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(output_size)
            set_weight_loader(self.bias, self.weight_loader)

    def slice_for(self, shard_id: Any) -> LinearSlice:
        """Where this rank's part of a checkpoint tensor (``shard_id``: q/k/v, gate/up, or None) lies in the
        source and in this layer; each parallel layer below says it (this base class holds none)."""
        raise NotImplementedError(f"{type(self).__name__} must define slice_for")

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: Any = None) -> None:
        sl = self.slice_for(shard_id)
        if param is self.bias:
            self._load_bias(param, source, sl)
        elif self.quant is not None:
            self.quant.load(self, param, source, sl)
        else:
            copy_checked(param.data.narrow(0, sl.dst_offset, sl.out_size), _read_slice(source, sl))

    def _load_bias(self, param: nn.Parameter, source: WeightSource, sl: LinearSlice) -> None:
        copy_checked(param.data.narrow(0, sl.dst_offset, sl.out_size), source.narrow(0, sl.out_start, sl.out_size))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)``. Dense weights: ``F.linear``, or the Triton GEMV where ``kernels.gemv.plan_gemv``
        picks it for this (M, N, K) on CUDA (a few rows: decode; a pure function of the shape, so a CUDA
        graph keeps the choice it was captured with)."""
        if self.quant is not None:
            y = self.quant.apply(self, x)
            return y if bias is None else y + bias
        assert self.weight is not None
        return dense_linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def forward_normed(self, norm: NormIn) -> torch.Tensor:
        """``forward(rms_norm(norm.h) * norm.weight)``, the norm computed as the dense GEMV loads its input where
        it can (``kernels.fused_norm``), else by its own launch first (always for 4-bit weights)."""
        if self.quant is not None:
            return self.forward(materialize(norm))
        assert self.weight is not None
        return dense_linear_normed(norm, self.weight, self.bias)

    def carries_norm(self, m: int, gated: bool = False) -> bool:
        """Whether ``m`` rows of this layer's matmul (of ``silu_and_mul(x2)`` when ``gated``) run a GEMV that can
        carry an RMSNorm (``forward_normed``, ``forward_residual``) on CUDA: the dense GEMV where
        ``kernels.gemv.linear`` takes it for this shape; never with 4-bit weights."""
        if self.quant is not None:
            return False
        assert self.weight is not None
        return takes_gemv(m, self.weight, gated)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split by rows (output features); each rank returns its slice of y."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, parallel: ParallelState, quant: QuantMethod | None = None
    ) -> None:
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, parallel.world_size, "output features")
        super().__init__(input_size, self.output_size_per_rank, bias, parallel, quant, is_row_parallel=False)

    def slice_for(self, shard_id: Any) -> LinearSlice:
        size = self.output_size_per_rank
        return LinearSlice(0, self.parallel.rank * size, size, 0, self.input_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up). Each rank's
    output is ``[shard of out 0 | shard of out 1 | ...]``; ``shard_id`` in the loader indexes the parts."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        parallel: ParallelState,
        quant: QuantMethod | None = None,
    ) -> None:
        self.output_sizes_per_rank = [divide(s, parallel.world_size, "output features") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, parallel, quant)

    def slice_for(self, shard_id: Any) -> LinearSlice:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id (index of the merged projection)")
        size = self.output_sizes_per_rank[shard_id]
        offset = sum(self.output_sizes_per_rank[:shard_id])
        return LinearSlice(offset, self.parallel.rank * size, size, 0, self.input_size)


class QKVParallelLinear(_ParallelLinear):
    """Q, K and V projections in one column-parallel matmul, split by attention head.

    Query heads must divide evenly over ranks. KV heads do too when there are at least as many as ranks;
    with fewer (GQA, e.g. 2 KV heads on 4 ranks) each rank keeps one KV head, replicated across the
    ``world_size / num_kv_heads`` ranks whose query heads use it. Per-rank output: ``[q | k | v]``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        parallel: ParallelState,
        quant: QuantMethod | None = None,
    ) -> None:
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
        self.input_size = hidden_size
        self.output_size_per_rank = self.q_size + 2 * self.kv_size
        super().__init__(hidden_size, self.output_size_per_rank, bias, parallel, quant, is_row_parallel=False)

    def slice_for(self, shard_id: Any) -> LinearSlice:
        if shard_id == "q":
            return LinearSlice(0, self.parallel.rank * self.q_size, self.q_size, 0, self.input_size)
        if shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            return LinearSlice(offset, self.kv_head_start * self.head_dim, self.kv_size, 0, self.input_size)
        raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q_size + 2 kv_size] -> q [T, heads, D], k and v [T, kv_heads, D] (per rank)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        return (
            q.reshape(t, self.num_heads, self.head_dim),  # [T, heads, D]
            k.reshape(t, self.num_kv_heads, self.head_dim),  # [T, kv_heads, D]
            v.reshape(t, self.num_kv_heads, self.head_dim),
        )


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split by columns (input features): the input arrives already split (the output
    of a column-parallel layer), partial products are all-reduced, then the (replicated) bias is added once."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, parallel: ParallelState, quant: QuantMethod | None = None
    ) -> None:
        self.input_size_per_rank = divide(input_size, parallel.world_size, "input features")
        self.output_size = output_size
        super().__init__(self.input_size_per_rank, output_size, bias, parallel, quant, is_row_parallel=True)
        # decided once: a runtime-checkable isinstance costs microseconds, forward_gated runs per layer and step
        self.gated_quant = quant if isinstance(quant, GatedQuantMethod) else None
        # a residual add after the all-reduce and the bias cannot ride on this rank's GEMV
        self.fusable = parallel.world_size == 1 and not bias

    def slice_for(self, shard_id: Any) -> LinearSlice:
        size = self.input_size_per_rank
        return LinearSlice(0, 0, self.output_size, self.parallel.rank * size, size)

    def _load_bias(self, param: nn.Parameter, source: WeightSource, sl: LinearSlice) -> None:
        copy_checked(param, read_full(source))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def forward_gated(self, x2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``forward(act(x2))`` for the gated MLP's down projection (``act``: silu_and_mul of ``x2 = gate | up``).
        Dense weights: ``kernels.gemv.linear_gated``, whose GEMV applies the activation as it loads x (no
        activation launch at batch 1); 4-bit weights: their ``apply_gated`` (the int4 GEMV does the same),
        or the activation, then their matmul, for a method without one."""
        if self.gated_quant is not None:
            y = self.parallel.all_reduce(self.gated_quant.apply_gated(self, x2, act))
        elif self.quant is not None:
            return self.forward(act(x2))
        else:
            assert self.weight is not None
            y = self.parallel.all_reduce(dense_linear_gated(x2, self.weight))
        return y if self.bias is None else y + self.bias

    def forward_residual(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor] | None,
        norm: RMSNorm,
    ) -> NormIn:
        """The input of ``norm`` applied to ``h = forward(x) + residual`` (``forward_gated(x, act)`` with ``act``),
        for the next projection to normalize (``kernels.fused_norm``): ``h`` and its sums of squares ``[M, P]``
        fp32, added and summed as the dense GEMV writes its output where it can, else after the matmul (one
        partial a row)."""
        if self.fusable and self.quant is None:
            assert self.weight is not None
            h, sumsq = dense_linear_residual(x, self.weight, residual, act is not None)
        else:
            y = self.forward_gated(x, act) if act is not None else self.forward(x)
            h, sumsq = residual_sum_ref(y, residual, 1)
        return NormIn(h, sumsq, norm.weight, norm.eps)
