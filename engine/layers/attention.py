"""The paged attention layer: rope on this step's q and k, K/V into its cache, attention through the block
tables."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, decode_with_rope, fuses_rope, paged_attention, write_kv
from engine.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """One layer's attention over its paged KV cache. It applies the rotary embedding itself, because on
    CUDA the rotation of k and its store into the cache are one kernel (which, on a prefill step, also hands
    the rotated key and the value to the prefill kernel: ``engine.attention.write_kv``).

    ``kv_cache`` (``[2, num_blocks, block_size, num_kv_heads, head_dim]``, per rank) is assigned by the
    ModelRunner after it has sized the cache; until then it is an empty tensor. It is a plain attribute,
    not a buffer, so it stays out of ``state_dict`` and parameter counts.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        rotary: RotaryEmbedding,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads  # per rank
        self.num_kv_heads = num_kv_heads  # per rank
        self.head_dim = head_dim
        self.scale = scale
        self.rotary_emb = rotary  # shared by every layer (one cos/sin cache)
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, num_heads, head_dim], not yet rotated (views of the QKV output are fine)
        key: torch.Tensor,  # [T, num_kv_heads, head_dim], not yet rotated
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.kv_cache.numel() == 0:
            raise RuntimeError("Attention.kv_cache is not set: the ModelRunner assigns it before the first forward")
        cos_sin_cache = self.rotary_emb.cos_sin_cache
        if fuses_rope(meta):  # a decode step: the decode kernel rotates and stores the new K/V itself
            return decode_with_rope(
                positions, query, key, value, cos_sin_cache, self.kv_cache, meta, self.scale, self.sliding_window
            )  # fmt: skip
        # new_kv: this step's rotated key and value side by side for the prefill kernel, or None (decode)
        query, new_kv = write_kv(positions, query, key, value, cos_sin_cache, self.kv_cache, meta)
        return paged_attention(query, self.kv_cache, meta, self.scale, self.sliding_window, new_kv)
