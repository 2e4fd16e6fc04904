"""Decode attention that applies the rotary embedding and writes the new token's K/V itself: a decode step's
rope + cache-write launch (``kernels.rope_cache``) folded into the decode kernel (``kernels.paged_attention``).

Every program of the decode kernel rotates its query rows as it loads them, and the one program of each
(sequence, KV head) whose partition holds the new token rotates that token's key and stores it and the value
at its cache slot, then a barrier, then reads its tiles as always (the new row from the cache, as the
unfused path reads it). The rotation is ``kernels.rotary``'s: fp32, the same products and sums, cast once, so
the rotated query and the cached key have the bits ``rope_and_cache`` gives them. The step's inputs are the
raw ``q``, ``k``, ``v`` (views of the QKV projection's output are fine), read, never written.
"""

from __future__ import annotations

import torch

from kernels.cache_write import check_cache_inputs
from kernels.paged_attention import _paged_decode_attention, paged_decode_attention_ref
from kernels.rope_cache import DecodeRope, rope_and_cache_ref
from kernels.rotary import check_rotary_inputs

__all__ = ["DecodeRope", "paged_decode_attention_rope", "paged_decode_attention_rope_ref"]


def paged_decode_attention_rope_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], not rotated
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], the new slots written here
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, the new token included
    scale: float,
    rope: DecodeRope,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The unfused path: :func:`kernels.rope_cache.rope_and_cache_ref`, then the decode reference."""
    q = rope_and_cache_ref(
        rope.positions, query, rope.key, rope.value, rope.cos_sin_cache, kv_cache, rope.slot_mapping
    )  # fmt: skip
    return paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, sliding_window)


def paged_decode_attention_rope(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], not rotated
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], the new slots written here
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, the new token included
    scale: float,
    rope: DecodeRope,
    sliding_window: int | None = None,
    **knobs: object,  # _paged_decode_attention's (tests force partitions)
) -> torch.Tensor:
    """Triton version of :func:`paged_decode_attention_rope_ref` (the rotation in fp32, as
    ``kernels.rope_cache.rope_and_cache``)."""
    check_rotary_inputs(rope.positions, query, rope.key, rope.cos_sin_cache)
    check_cache_inputs(rope.key, rope.value, kv_cache, rope.slot_mapping)
    if rope.key.stride() != rope.value.stride():
        raise ValueError(f"key and value need the same strides, got {rope.key.stride()} and {rope.value.stride()}")
    return _paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale, sliding_window, rope=rope, **knobs)  # type: ignore[arg-type]
