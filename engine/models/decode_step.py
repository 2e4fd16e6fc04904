"""A path of ``LlamaModel.forward``: a batch-1 decode step of a 4-bit model runs every decoder layer in one launch
(``kernels.int4_decode_step``) instead of ~270 kernels, where every layer fits that kernel (#13's batch-1 goal).

Off by default: it has not yet run on a GPU. ``PAGEDSERVE_INT4_DECODE_STEP=1`` turns it on, on CUDA (tests add
"cpu", where the Triton interpreter runs it). The model fits when its projections are 4-bit without act-order, one
group size, no biases, no q/k norms, no sliding window, rope over the whole head, one rank. The kernel reads the
step's ``seq_lens`` and block table from the device, so CUDA graphs replay it; its kernel object is rebuilt if the
KV caches are reallocated.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.quantization.int4_linear import Int4LinearMethod
from kernels.int4_decode_plan import StepShape, StepTiles, fit_tiles
from kernels.int4_decode_tasks import Int4DecodeStep, Int4Proj, StepLayer, shape_reason

DECODE_STEP = os.environ.get("PAGEDSERVE_INT4_DECODE_STEP") == "1"
DECODE_STEP_DEVICES = ("cuda",)
DECODE_STEP_TILES = StepTiles()  # fitted to the model (kernels.int4_decode_plan.fit_tiles)


def unfit_reason(model: Any) -> str | None:
    """Why ``model`` (a ``LlamaModel``) cannot take the one-launch step, or None."""
    if model.parallel.world_size > 1:
        return "tensor parallel"
    groups = set()
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(proj.quant, Int4LinearMethod) or proj.g_idx is not None or proj.bias is not None:
                return "a projection that is not 4-bit without act-order and bias"
            groups.add(proj.group_size)
        if attn.q_norm is not None or attn.attn.sliding_window is not None:
            return "q/k norms or a sliding window"
    if len(groups) > 1:
        return "several group sizes"
    if model.rotary_emb.cos_sin_cache.shape[1] != model.layers[0].self_attn.attn.head_dim:
        return "rope over part of the head"
    return shape_reason(step_layers(model)[1])


def step_layers(model: Any) -> tuple[list[StepLayer], StepShape]:
    """The kernel's view of a ``LlamaModel``'s layers (the weights and caches themselves, not copies)."""
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = (Int4Proj(p.qweight, p.scales, p.zeros) for p in (attn.qkv_proj, attn.o_proj,
                                 mlp.gate_up_proj, mlp.down_proj))  # fmt: skip
        layers.append(StepLayer(qkv, o, gate_up, down, layer.input_layernorm.weight,
                                layer.post_attention_layernorm.weight, attn.attn.kv_cache))  # fmt: skip
    first = model.layers[0]
    inner = first.self_attn.attn
    shape = StepShape(
        inner.num_heads, inner.num_kv_heads, inner.head_dim, first.self_attn.qkv_proj.group_size,
        first.input_layernorm.eps, inner.scale,
    )  # fmt: skip
    return layers, shape


class DecodeStepPath:
    """The path for one ``LlamaModel``: whether a step takes it (:meth:`takes`) and the launch (:meth:`run`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.reason = unfit_reason(model)
        self.step: tuple[int, Int4DecodeStep] | None = None  # (the first cache's address, the kernel for it)

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode step of one sequence, on a device the path is on, of a model that fits."""
        on = DECODE_STEP and hidden.device.type in DECODE_STEP_DEVICES and self.reason is None
        cached = self.model.layers[0].self_attn.attn.kv_cache.numel() > 0  # not the memory profile's forward
        return on and cached and hidden.shape[0] == 1 and meta.is_decode_only and meta.num_seqs == 1

    def run(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every layer on ``hidden`` (the step's embedding, ``[1, hidden]``) in place; the new K/V into the caches."""
        cache = self.model.layers[0].self_attn.attn.kv_cache.data_ptr()
        if self.step is None or self.step[0] != cache:
            layers, shape = step_layers(self.model)
            width, inter = layers[0].in_norm.numel(), layers[0].down.qweight.shape[0] * 8
            tiles = fit_tiles(shape, width, inter, DECODE_STEP_TILES)
            self.step = (cache, Int4DecodeStep(layers, shape, tiles))
        self.step[1](hidden[0], meta.seq_lens, meta.block_tables[0], self.model.rotary_emb.cos_sin_cache)
        return hidden
