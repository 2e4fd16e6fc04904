"""The 4-bit weights of one linear layer: which parameters it holds, how a rank's slice of each checkpoint
tensor lands in them, and the GEMM (Triton on CUDA, the torch reference elsewhere). On CUDA, steps of fewer
than ``DEQUANT_MIN_M`` tokens run the fused int4 GEMM; larger ones dequantize the layer's weight into one
scratch buffer shared by all layers and call cuBLAS (``kernels.int4_dequant`` says why). The MLP's down
projection takes gate_up's output itself (``apply_gated``): below ``DEQUANT_MIN_M`` tokens the GEMM applies
the activation as it loads x (``kernels.int4_gemm.int4_gemm_gated``), with the dense layers' switch
(``kernels.gemv.GEMV_GATED``, PAGEDSERVE_GEMV_GATED=0 turns both off)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.layers.weights import LinearSlice, WeightSource, copy_checked, set_weight_loader
from engine.quantization.config import Int4Config
from engine.quantization.formats import read_qweight, read_scales, read_zeros
from kernels import gemv as dense_gemv
from kernels import int4_plan
from kernels._triton import HAS_TRITON
from kernels.int4_dequant import DEQUANT_MIN_M, PACK, DequantScratch, int4_dequant_linear
from kernels.int4_gemm import int4_gemm, int4_gemm_gated, int4_gemm_ref
from kernels.int4_gemm_wgmma import wgmma_available

SYMMETRIC_ZERO = 8  # the zero code of symmetric 4-bit weights (signed values stored with an offset of 8)


def _new(shape: tuple[int, ...], dtype: torch.dtype | None, kind: str, loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.int4_kind = kind  # type: ignore[attr-defined]
    set_weight_loader(param, loader)
    return param


class Int4LinearMethod:
    """Creates ``qweight``/``scales``/``zeros``/``g_idx`` on a linear layer (layout of ``kernels.int4_dequant``)
    and fills them from any supported format; ``apply`` is the layer's matmul. One instance serves a whole
    model (one rank of it): it holds the dequantization scratch, sized for the largest layer it created."""

    def __init__(self, config: Int4Config) -> None:
        self.config = config
        self.scratch = DequantScratch()

    def create_weights(
        self, layer: Any, input_size: int, output_size: int, loader: Callable[..., None], is_row_parallel: bool
    ) -> None:
        """``input_size``/``output_size``: this rank's; ``loader(param, source[, shard_id])`` is the layer's."""
        c = self.config
        if input_size % PACK:
            raise ValueError(f"input features per rank ({input_size}) must be a multiple of {PACK} for 4-bit weights")
        full_input = input_size * (layer.parallel.world_size if is_row_parallel else 1)
        if c.group_size is None:
            group_size, num_groups = input_size, 1
        elif c.act_order:  # g_idx may send any input feature to any group: every rank keeps all groups
            group_size, num_groups = c.group_size, -(-full_input // c.group_size)
        else:
            if input_size % c.group_size:
                raise ValueError(
                    f"input features per rank ({input_size}) must be a multiple of group_size ({c.group_size}): "
                    "tensor-parallel slices may not cut a quantization group"
                )
            group_size, num_groups = c.group_size, input_size // c.group_size
        layer.group_size = group_size
        self.scratch.reserve(output_size, input_size)  # this rank's slice: what apply dequantizes
        layer.qweight = _new((input_size // PACK, output_size), torch.int32, "qweight", loader)
        layer.scales = _new((num_groups, output_size), None, "scales", loader)
        if c.has_zeros:
            layer.zeros = _new((num_groups, output_size), torch.uint8, "zeros", loader)
        else:
            layer.register_buffer("zeros", torch.full((num_groups, output_size), SYMMETRIC_ZERO, dtype=torch.uint8))
        layer.g_idx = _new((input_size,), torch.int32, "g_idx", loader) if c.act_order else None
        layer.g_idx_loaded = False
        for p in (layer.qweight, layer.scales, getattr(layer, "zeros", None), layer.g_idx):
            if isinstance(p, nn.Parameter):
                p.dummy_init = self._dummy_init  # type: ignore[attr-defined]

    def _groups(self, layer: Any, sl: LinearSlice) -> tuple[int, int]:
        num_groups = layer.scales.shape[0]
        if self.config.group_size is None or self.config.act_order:
            return 0, num_groups
        return sl.in_start // layer.group_size, num_groups

    @torch.no_grad()
    def load(self, layer: Any, param: nn.Parameter, source: WeightSource, sl: LinearSlice) -> None:
        kind = param.int4_kind  # type: ignore[attr-defined]
        c = self.config
        if kind == "g_idx":
            g_idx = source.narrow(0, sl.in_start, sl.in_size).to(torch.int32)
            if layer.g_idx_loaded and not torch.equal(param, g_idx):
                raise ValueError("merged projections (q/k/v or gate/up) with different g_idx are not supported")
            copy_checked(param, g_idx, "g_idx")
            layer.g_idx_loaded = True
            return
        if kind == "qweight":
            piece = read_qweight(c, source, sl.out_start, sl.out_size, sl.in_start, sl.in_size)
        else:
            g0, g = self._groups(layer, sl)
            read = read_scales if kind == "scales" else read_zeros
            piece = read(c, source, sl.out_start, sl.out_size, g0, g)
        copy_checked(param.data.narrow(1, sl.dst_offset, sl.out_size), piece, kind)

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and HAS_TRITON:
            return self.apply_triton(layer, x)
        return int4_gemm_ref(x, layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.g_idx)

    def apply_triton(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path (tests run it on CPU under the Triton interpreter). Decode graphs capture
        it up to max_num_seqs rows, so at M >= DEQUANT_MIN_M too: the scratch is allocated by the first
        such step, which the profile run or the graphs' warm-up makes before any capture."""
        weights = (layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.g_idx)
        if self.dequantizes(layer, x):
            return int4_dequant_linear(x, *weights, scratch=self.scratch)
        return int4_gemm(x, *weights)

    def dequantizes(self, layer: Any, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows go to the dense weight (dequantized, then cuBLAS): from DEQUANT_MIN_M rows, but not
        where the wgmma GEMM runs them (``kernels.int4_plan.WGMMA_M`` on sm_90; faster up to 128 rows)."""
        if x.shape[0] < DEQUANT_MIN_M:
            return False
        wgmma = int4_plan.default_kernel(x.shape[0]) == "wgmma"  # read per call: benchmarks switch WGMMA_M
        return not (wgmma and wgmma_available(x, layer.group_size, layer.g_idx is not None))

    def apply_gated(self, layer: Any, x2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``apply(layer, act(x2))`` for the gated MLP's down projection (``x2 = gate | up``, ``act`` its
        silu_and_mul): the CUDA path below ``DEQUANT_MIN_M`` rows skips the activation launch."""
        if x2.is_cuda and HAS_TRITON:
            return self.apply_gated_triton(layer, x2, act)
        return self.apply(layer, act(x2))

    def apply_gated_triton(
        self, layer: Any, x2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The CUDA path of ``apply_gated`` (tests run it on CPU under the Triton interpreter). The gated GEMM
        computes ``silu_and_mul`` itself, rounded as ``act`` (the SiluAndMul layer) rounds it."""
        if dense_gemv.GEMV_GATED and x2.shape[0] < DEQUANT_MIN_M:  # read per call: tests switch it
            return int4_gemm_gated(x2, layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.g_idx)
        return self.apply_triton(layer, act(x2))

    @staticmethod
    @torch.no_grad()
    def _dummy_init(param: nn.Parameter, gen: torch.Generator) -> None:
        """Random codes and zeros, scales giving weights of std ~0.02 (as the dense dummy weights)."""
        kind = param.int4_kind  # type: ignore[attr-defined]
        if kind == "qweight":
            param.random_(-(2**31), 2**31 - 1, generator=gen)
        elif kind == "zeros":
            param.random_(6, 10, generator=gen)
        elif kind == "scales":
            param.uniform_(0.002, 0.006, generator=gen)
        else:  # g_idx: every input in group 0, which exists whatever the group count
            param.zero_()
