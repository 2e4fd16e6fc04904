"""The paged attention layer: writes this step's K/V into its cache and attends through the block tables."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention


class Attention(nn.Module):
    """One layer's attention over its paged KV cache.

    ``kv_cache`` (``[2, num_blocks, block_size, num_kv_heads, head_dim]``, per rank) is assigned by the
    ModelRunner after it has sized the cache; until then it is an empty tensor. It is a plain attribute,
    not a buffer, so it stays out of ``state_dict`` and parameter counts.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads  # per rank
        self.num_kv_heads = num_kv_heads  # per rank
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.kv_cache.numel() == 0:
            raise RuntimeError("Attention.kv_cache is not set: the ModelRunner assigns it before the first forward")
        return paged_attention(query, key, value, self.kv_cache, meta, self.scale, self.sliding_window)
