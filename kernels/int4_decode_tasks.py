"""The one-launch int4 decode step (``kernels.int4_decode_step``): its weights as the kernel sees them, its
buffers and launch (:class:`Int4DecodeStep`; the task table comes from ``kernels.int4_decode_plan``), and its
torch reference (:func:`int4_decode_step_ref`: the engine's layer arithmetic on the same weights, layer by layer,
with the same references its CPU path runs)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels._triton import next_pow2, require_triton
from kernels.activation import silu_and_mul_ref
from kernels.int4_decode_plan import StepShape, StepTiles, plan_tasks, proj_ks
from kernels.int4_decode_step import (
    IN_NORM,
    KV_CACHE,
    POST_NORM,
    PTR_FIELDS,
    TRACE_FIELDS,
    _int4_decode_step_kernel,
)
from kernels.int4_gemm import int4_gemm_ref
from kernels.int4_plan import num_sms
from kernels.norm import rms_norm_ref
from kernels.paged_attention import paged_decode_attention_ref
from kernels.rotary import rotary_embedding_ref


@dataclass(frozen=True)
class Int4Proj:
    """One projection's packed weights (``kernels.int4_dequant``'s layout, no g_idx), all contiguous."""

    qweight: torch.Tensor  # [K // 8, N] int32
    scales: torch.Tensor  # [K // group, N], x's dtype
    zeros: torch.Tensor  # [K // group, N] uint8


@dataclass(frozen=True)
class StepLayer:
    """A Llama decoder layer: fused qkv and gate_up projections, its two RMSNorm weights, its KV cache."""

    qkv: Int4Proj
    o: Int4Proj
    gate_up: Int4Proj
    down: Int4Proj
    in_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]


class Int4DecodeStep:
    """Every layer of a batch-1 decode step in one launch (``kernels.int4_decode_step``) over ``layers``, whose
    KV caches share one shape. Calls update ``hidden`` (the residual stream ``[hidden]``, the embedding in) and the
    caches in place."""

    def __init__(self, layers: list[StepLayer], shape: StepShape, tiles: StepTiles = StepTiles()):
        require_triton("int4_decode_step")
        first = layers[0]
        self.layers, self.shape, self.tiles = layers, shape, tiles
        self.device, self.dtype = first.in_norm.device, first.in_norm.dtype
        self.hidden = first.in_norm.numel()
        self.inter = first.down.qweight.shape[0] * 8
        hqd, kvd = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.nqkv = hqd + 2 * kvd
        _check(layers, shape, tiles, self.hidden, self.inter, hqd)
        self.block_size = first.kv_cache.shape[2]
        self.p_max = tiles.parts
        self.plan = plan_tasks(shape, self.hidden, self.inter, len(layers), tiles)
        self.tasks = torch.tensor(self.plan.rows, dtype=torch.int32, device=self.device)
        self.num_counters = self.plan.num_counters
        self.counters = torch.zeros(self.num_counters, dtype=torch.int32, device=self.device)
        q0 = first.qkv
        # the weights' and caches' offsets in the table are from these
        self.bases = (q0.qweight, q0.scales, q0.zeros, first.kv_cache)
        self.ptrs = torch.tensor([_pointers(layer, self.bases) for layer in layers], dtype=torch.int64,
                                 device=self.device)  # fmt: skip
        new = lambda *size, dtype=self.dtype: torch.empty(size, dtype=dtype, device=self.device)  # noqa: E731
        self.qkv, self.attn, self.act = new(self.nqkv), new(hqd), new(self.inter)
        self.proj = torch.tensor(self.plan.proj, dtype=torch.int32, device=self.device)
        self.gws = torch.zeros(self.plan.gws_size, dtype=torch.float32, device=self.device)
        self.stream = new(self.hidden)  # the residual stream between o_proj and down_proj (ping-pong with hidden)
        # the streams times their next norm's weight: h's (the next input_layernorm), then h2's
        self.normed = new(2 * self.hidden)
        self.ws_o = new(shape.heads, self.p_max, shape.head_dim, dtype=torch.float32)
        self.ws_m, self.ws_l = (
            new(shape.heads, self.p_max, dtype=torch.float32),
            new(shape.heads, self.p_max, dtype=torch.float32),
        )
        self.interpreted = os.environ.get("TRITON_INTERPRET") == "1" or self.device.type != "cuda"
        # the interpreter runs programs one after another: one program, or the first would wait forever
        self.grid = 1 if self.interpreted else tiles.programs_per_sm * num_sms(self.device.index or 0)

    def __call__(
        self,
        hidden: torch.Tensor,  # [hidden], contiguous: the embedding in, the last layer's residual stream out
        seq_len: torch.Tensor,  # [1] int32: the new token's position + 1
        block_table: torch.Tensor,  # [max_blocks] int32
        cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos, then sin
        trace: torch.Tensor | None = None,  # [tasks, TRACE_FIELDS] int64: each task's timestamps (compiled only)
    ) -> None:
        shape, tiles, first = self.shape, self.tiles, self.layers[0]
        if trace is not None and (self.grid == 1 or trace.shape != (len(self.plan.rows), TRACE_FIELDS)):
            raise ValueError(f"trace: [{len(self.plan.rows)}, {TRACE_FIELDS}] int64 on a GPU, not the interpreter")
        # the first layer's stream times its norm weight; the kernel writes the others as it writes the streams
        torch.mul(hidden, first.in_norm, out=self.normed[: self.hidden])
        _int4_decode_step_kernel[(self.grid,)](
            self.tasks, self.tasks.shape[0], self.counters, self.num_counters, self.ptrs, *self.bases, hidden,
            self.stream, self.normed,
            self.qkv, self.attn, self.act, self.ws_o, self.ws_m, self.ws_l, self.gws, self.proj,
            block_table, seq_len, cos_sin_cache, self.counters if trace is None else trace, first.kv_cache[0].numel(), shape.scale, shape.eps, 0x3F800000,
            self.hidden, self.inter, shape.heads, shape.kv_heads, self.p_max, len(self.layers), self.plan.head_slots,
            self.plan.tile_slots,
            GROUP=shape.group_size, HP=next_pow2(self.hidden), D=shape.head_dim, QG=shape.heads // shape.kv_heads,
            BS=self.block_size, BT=tiles.bt, PP=next_pow2(self.p_max), BK=tiles.bk, TN=tiles.tn,
            NUM_STAGES=tiles.num_stages, TRACE=trace is not None, COMPILED=not self.interpreted,
            num_warps=tiles.num_warps, **({"maxnreg": tiles.maxnreg} if tiles.maxnreg else {}),
        )  # fmt: skip


def _pointers(layer: StepLayer, bases: tuple[torch.Tensor, ...]) -> list[int]:
    """A layer's row of the table: its weights and KV cache as offsets in elements from ``bases`` (qweight, scales,
    zeros, the first layer's cache), each a multiple of 16 bytes; its norm weights as addresses."""
    row = [0] * PTR_FIELDS
    arrays = [(3 * i + j, t, bases[j]) for i, p in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down))
              for j, t in enumerate((p.qweight, p.scales, p.zeros))]  # fmt: skip
    for field, t, base in [*arrays, (KV_CACHE, layer.kv_cache, bases[3])]:
        gap = t.data_ptr() - base.data_ptr()
        if gap % 16:
            raise ValueError("every int4 weight, scale and zero array and every KV cache must start 16-byte aligned")
        row[field] = gap // t.element_size()
    row[IN_NORM], row[POST_NORM] = layer.in_norm.data_ptr(), layer.post_norm.data_ptr()
    return row


def shape_reason(shape: StepShape) -> str | None:
    """Why the kernel cannot run a model of ``shape`` (its tiles are powers of two: the head and the query heads
    a KV head serves; attention's ``tl.dot`` wants a head of at least 16), or None."""
    group = shape.heads // shape.kv_heads
    if shape.heads % shape.kv_heads or group & (group - 1) or shape.head_dim & (shape.head_dim - 1):
        return (
            f"{shape.heads} heads on {shape.kv_heads} KV heads of {shape.head_dim}: powers of two per KV head and dim"
        )
    if shape.head_dim < 16:
        return f"head_dim {shape.head_dim}: attention's MMA needs at least 16"
    return None


def _check(layers: list[StepLayer], shape: StepShape, tiles: StepTiles, hidden: int, inter: int, hqd: int) -> None:
    """ValueError unless every layer has the shapes, dtypes and layout the kernel reads."""
    group, cache = shape.group_size, layers[0].kv_cache
    if tiles.tn % 2 or tiles.bk % 8 or group % tiles.bk or any(k % tiles.bk for k in (hidden, inter, hqd)):
        raise ValueError(f"tiles {tiles}: tn even, bk a multiple of 8 dividing the group {group} and every K")
    if tiles.bt < 16 or tiles.bt & (tiles.bt - 1):
        raise ValueError(f"tiles {tiles}: bt a power of two of at least 16 (attention's MMA)")
    dtype = layers[0].in_norm.dtype
    ks = proj_ks(hidden, inter, hqd)
    if len(tiles.splits) != 4 or any(not 1 <= s <= k // tiles.bk for s, k in zip(tiles.splits, ks, strict=False)):
        raise ValueError(f"splits {tiles.splits}: four, each from 1 to its projection's K / bk")
    reason = shape_reason(shape)
    if reason is not None:
        raise ValueError(reason)
    dims = {"qkv": (hidden, hqd + 2 * shape.kv_heads * shape.head_dim), "o": (hqd, hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}  # fmt: skip
    for layer in layers:
        for name, (k, n) in dims.items():
            proj = getattr(layer, name)
            want = {"qweight": (k // 8, n), "scales": (k // group, n), "zeros": (k // group, n)}
            for field, size in want.items():
                t = getattr(proj, field)
                if tuple(t.shape) != size or not t.is_contiguous():
                    raise ValueError(f"{name}.{field}: {tuple(t.shape)} (contiguous: {t.is_contiguous()}), want {size}")
        if layer.kv_cache.shape != cache.shape or not layer.kv_cache.is_contiguous():
            raise ValueError("every layer's KV cache must have the first one's shape, contiguous")
        if layer.kv_cache.dtype != dtype:  # attention's tl.dot takes queries and keys of one dtype
            raise ValueError(f"the KV cache's dtype {layer.kv_cache.dtype} must be the activations' {dtype}")
        if layer.in_norm.dtype != layers[0].in_norm.dtype or layer.in_norm.numel() != hidden:
            raise ValueError("norm weights of one dtype and the hidden size")


def int4_decode_step_ref(
    layers: list[StepLayer],
    shape: StepShape,
    hidden: torch.Tensor,  # [hidden]
    seq_len: int,
    block_table: torch.Tensor,  # [max_blocks] int32
    cos_sin_cache: torch.Tensor,
) -> torch.Tensor:
    """The residual stream after every layer (the new tokens' K/V written to the caches), as the engine computes it
    on CPU: RMSNorm, the int4 projections dequantized, rope, the paged decode attention, SiLU-mul, residual adds."""
    h = hidden[None, :]
    pos = torch.tensor([seq_len - 1], device=hidden.device)
    hqd, kvd, d = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.head_dim

    def proj(x: torch.Tensor, p: Int4Proj) -> torch.Tensor:
        return int4_gemm_ref(x, p.qweight, p.scales, p.zeros, shape.group_size)

    for layer in layers:
        x = rms_norm_ref(h, layer.in_norm, shape.eps)
        assert isinstance(x, torch.Tensor)
        qkv = proj(x, layer.qkv)
        q, k = rotary_embedding_ref(
            pos, qkv[:, :hqd].reshape(1, -1, d), qkv[:, hqd : hqd + kvd].reshape(1, -1, d), cos_sin_cache
        )  # fmt: skip
        block_size = layer.kv_cache.shape[2]
        blk, off = int(block_table[(seq_len - 1) // block_size]), (seq_len - 1) % block_size
        layer.kv_cache[0, blk, off] = k[0]
        layer.kv_cache[1, blk, off] = qkv[0, hqd + kvd :].reshape(-1, d)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=hidden.device)
        attn = paged_decode_attention_ref(q, layer.kv_cache, block_table[None, :], seq_lens, shape.scale)
        x, h = rms_norm_ref(proj(attn.reshape(1, -1), layer.o), layer.post_norm, shape.eps, h)
        h = h + proj(silu_and_mul_ref(proj(x, layer.gate_up)), layer.down)
    return h[0]
