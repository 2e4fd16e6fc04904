"""Rotary position embedding, neox style (rotate halves), from a precomputed cos/sin cache.

Rope scaling (linear, dynamic-free Llama 3, YaRN-free) is folded into the cache by the model layer;
the kernel only applies it.
"""

from __future__ import annotations

import torch


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.to(torch.long)]  # [T, head_dim]
    cos = cs[:, None, :half].to(query.dtype)  # [T, 1, half]
    sin = cs[:, None, half:].to(query.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(query), rotate(key)
