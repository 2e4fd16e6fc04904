"""Attention metadata (built once per step by the ModelRunner) and the paged attention backends.

Every attention layer receives the same ``AttentionMetadata`` explicitly through ``forward``; there is no
module-level state. The backend is the only thing that differs between CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import paged_decode_attention_ref
from kernels.prefill_attention import paged_prefill_attention_ref
from kernels.rope_cache import rope_and_cache_ref

BACKENDS = ("torch", "triton")


@dataclass
class AttentionMetadata:
    """The flat batch of one step: sequences back to back, each contributing ``q_len`` new tokens."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 for padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of q_len
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens per sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int  # 1 = decode-only step (CUDA graphs, decode kernel)
    max_seq_len: int
    backend: str = "torch"

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Rope on query and key, then this step's key and value into the cache at ``meta.slot_mapping``
    (one fused kernel on the Triton backend). Returns the rotated query; the rotated key lives only in the cache."""
    if meta.backend == "triton":
        from kernels.rope_cache import rope_and_cache

        return rope_and_cache(positions, query, key, value, cos_sin_cache, kv_cache, meta.slot_mapping)
    return rope_and_cache_ref(positions, query, key, value, cos_sin_cache, kv_cache, meta.slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's K/V written
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attend through the block tables. Returns ``[num_tokens, num_heads, head_dim]``."""
    if meta.backend == "triton":
        from kernels.paged_attention import paged_decode_attention
        from kernels.prefill_attention import paged_prefill_attention

        if meta.is_decode_only:
            return paged_decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
        return paged_prefill_attention(
            query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, sliding_window
        )
    if meta.is_decode_only:
        return paged_decode_attention_ref(query, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
    return paged_prefill_attention_ref(
        query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, sliding_window
    )
