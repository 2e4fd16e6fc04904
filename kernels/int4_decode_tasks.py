"""The one-launch int4 decode step (``kernels.int4_decode_step``): its weights as the kernel sees them, its task
table, buffers and launch (:class:`Int4DecodeStep`), and its torch reference (:func:`int4_decode_step_ref`: the
engine's layer arithmetic on the same weights, layer by layer, with the same references its CPU path runs)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from kernels._triton import next_pow2, require_triton
from kernels.activation import silu_and_mul_ref
from kernels.int4_decode_step import (
    ATTN,
    DOWN,
    GATE_UP,
    IN_NORM,
    KV_CACHE,
    O_PROJ,
    PHASES,
    POST_NORM,
    PTR_FIELDS,
    QKV,
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


@dataclass(frozen=True)
class StepShape:
    heads: int
    kv_heads: int
    head_dim: int
    group_size: int
    eps: float
    scale: float


@dataclass(frozen=True)
class StepTiles:
    """Launch choices, not yet tuned on a GPU: ``tn`` output columns a GEMV task, ``bk`` k's a loop step (dividing
    the group), ``parts`` attention partitions a KV head (the context split over them), ``bt`` keys a step of their
    loops, ``num_stages`` loads in flight in both loops, programs per SM, and K split over ``splits`` tasks per
    projection (qkv, o, gate_up, down)."""

    # guesses from the byte counts, to be swept (loadtest.decode_step_bench --tiles): 64 columns x 128 k's of int4 is
    # 4 KB a load, 4 in flight a program, 2 programs an SM: 32 KB in flight an SM, about what 4.2 TB/s needs over
    # 132 SMs at ~1 us of latency; splits give every phase ~200 tasks
    tn: int = 64
    bk: int = 128
    num_stages: int = 4
    parts: int = 16
    bt: int = 16
    programs_per_sm: int = 2
    splits: tuple[int, int, int, int] = (2, 4, 1, 4)
    prefetch: bool = False  # the next task's words asked of the L2 when claimed (sm_90 only: not the interpreter)


def fit_tiles(shape: StepShape, hidden: int, inter: int, tiles: StepTiles = StepTiles()) -> StepTiles:
    """``tiles`` for a model they may not fit: ``bk`` at most the group's largest power-of-two divisor, each split
    at most its projection's K / bk."""
    bk = min(tiles.bk, shape.group_size & -shape.group_size)
    ks = _proj_ks(hidden, inter, shape.heads * shape.head_dim)
    splits = tuple(max(1, min(s, k // bk)) for s, k in zip(tiles.splits, ks, strict=True))
    return replace(tiles, bk=bk, splits=splits)  # type: ignore[arg-type]


def _proj_ks(hidden: int, inter: int, hqd: int) -> tuple[int, int, int, int]:
    """The input features of qkv, o, gate_up and down (the order of ``StepTiles.splits``)."""
    return hidden, hqd, hidden, inter


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def task_table(num_layers: int, counts: dict[int, int], device: torch.device) -> torch.Tensor:
    """``[tasks, 6]`` int32 rows (kind, layer, index, wait slot, wait target, done slot), phase by phase; the phase
    counter of layer ``l``, kind ``f`` is slot ``l * PHASES + f``. ``counts``: tasks a phase by kind."""
    before = {QKV: DOWN, ATTN: QKV, O_PROJ: ATTN, GATE_UP: O_PROJ, DOWN: GATE_UP}
    rows = []
    for layer in range(num_layers):
        for kind in (QKV, ATTN, O_PROJ, GATE_UP, DOWN):
            wait_layer = layer - 1 if kind == QKV else layer
            slot, target = (0, 0) if wait_layer < 0 else (wait_layer * PHASES + before[kind], counts[before[kind]])
            rows += [(kind, layer, i, slot, target, layer * PHASES + kind) for i in range(counts[kind])]
    return torch.tensor(rows, dtype=torch.int32, device=device)


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
        col_tiles = {QKV: _cdiv(self.nqkv, tiles.tn), O_PROJ: _cdiv(self.hidden, tiles.tn),
                     GATE_UP: _cdiv(self.inter, tiles.tn // 2), DOWN: _cdiv(self.hidden, tiles.tn)}  # fmt: skip
        splits = dict(zip((QKV, O_PROJ, GATE_UP, DOWN), tiles.splits, strict=True))
        counts = {kind: n * splits[kind] for kind, n in col_tiles.items()} | {ATTN: shape.kv_heads * self.p_max}
        self.tasks = task_table(len(layers), counts, self.device)
        self.head_slots = len(layers) * PHASES
        self.tile_slots = self.head_slots + len(layers) * shape.kv_heads
        self.num_counters = self.tile_slots + max(col_tiles.values()) + 2  # + the claim and exit counters
        self.counters = torch.zeros(self.num_counters, dtype=torch.int32, device=self.device)
        self.ptrs = torch.tensor([_pointers(layer) for layer in layers], dtype=torch.int64, device=self.device)
        new = lambda *size, dtype=self.dtype: torch.empty(size, dtype=dtype, device=self.device)  # noqa: E731
        self.qkv, self.attn, self.act = new(self.nqkv), new(hqd), new(self.inter)
        self.splits = torch.tensor(tiles.splits, dtype=torch.int32, device=self.device)
        self.gws = torch.zeros(max(self.nqkv, 2 * self.inter, self.hidden), dtype=torch.float32, device=self.device)
        self.ones = torch.ones(max(self.hidden, self.inter, hqd), dtype=self.dtype, device=self.device)
        self.ws_o = new(shape.heads, self.p_max, shape.head_dim, dtype=torch.float32)
        self.ws_m, self.ws_l = (
            new(shape.heads, self.p_max, dtype=torch.float32),
            new(shape.heads, self.p_max, dtype=torch.float32),
        )
        interpreted = os.environ.get("TRITON_INTERPRET") == "1" or self.device.type != "cuda"
        # the interpreter runs programs one after another: one program, or the first would wait forever
        self.grid = 1 if interpreted else tiles.programs_per_sm * num_sms(self.device.index or 0)

    def __call__(
        self,
        hidden: torch.Tensor,  # [hidden], contiguous: the embedding in, the last layer's residual stream out
        seq_len: torch.Tensor,  # [1] int32: the new token's position + 1
        block_table: torch.Tensor,  # [max_blocks] int32
        cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos, then sin
    ) -> None:
        shape, tiles, first = self.shape, self.tiles, self.layers[0]
        _int4_decode_step_kernel[(self.grid,)](
            self.tasks, self.tasks.shape[0], self.counters, self.num_counters, self.ptrs,
            hidden, self.qkv, self.attn, self.act, self.ones, self.ws_o, self.ws_m, self.ws_l, self.gws, self.splits,
            block_table, seq_len, cos_sin_cache, first.kv_cache[0].numel(), shape.scale, shape.eps, 0x3F800000,
            self.hidden, self.inter, shape.heads, shape.kv_heads, self.p_max, self.head_slots, self.tile_slots,
            GROUP=shape.group_size, HP=next_pow2(self.hidden), D=shape.head_dim, QG=shape.heads // shape.kv_heads,
            BS=self.block_size, BT=tiles.bt, PP=next_pow2(self.p_max), BK=tiles.bk, TN=tiles.tn,
            NUM_STAGES=tiles.num_stages, PREFETCH=tiles.prefetch,
        )  # fmt: skip


def _pointers(layer: StepLayer) -> list[int]:
    row = [0] * PTR_FIELDS
    for i, proj in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
        row[3 * i : 3 * i + 3] = [proj.qweight.data_ptr(), proj.scales.data_ptr(), proj.zeros.data_ptr()]
    row[IN_NORM], row[POST_NORM], row[KV_CACHE] = (
        layer.in_norm.data_ptr(), layer.post_norm.data_ptr(), layer.kv_cache.data_ptr(),
    )  # fmt: skip
    return row


def shape_reason(shape: StepShape) -> str | None:
    """Why the kernel cannot run a model of ``shape`` (its tiles are powers of two: the head and the query heads
    a KV head serves), or None."""
    group = shape.heads // shape.kv_heads
    if shape.heads % shape.kv_heads or group & (group - 1) or shape.head_dim & (shape.head_dim - 1):
        return (
            f"{shape.heads} heads on {shape.kv_heads} KV heads of {shape.head_dim}: powers of two per KV head and dim"
        )
    return None


def _check(layers: list[StepLayer], shape: StepShape, tiles: StepTiles, hidden: int, inter: int, hqd: int) -> None:
    """ValueError unless every layer has the shapes, dtypes and layout the kernel reads."""
    group, cache = shape.group_size, layers[0].kv_cache
    if tiles.tn % 2 or tiles.bk % 8 or group % tiles.bk or any(k % tiles.bk for k in (hidden, inter, hqd)):
        raise ValueError(f"tiles {tiles}: tn even, bk a multiple of 8 dividing the group {group} and every K")
    ks = _proj_ks(hidden, inter, hqd)
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
