"""Scatter this step's K/V into the paged cache by slot (slot = block_id * block_size + offset)."""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
) -> None:
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.long)
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[valid].to(kv_cache.dtype)
