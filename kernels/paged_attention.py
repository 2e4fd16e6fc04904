"""Paged attention over the KV cache layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

Block tables are ``[num_seqs, max_blocks_per_seq]`` int32, padded with 0 (a valid block id; entries
past a sequence's length are never read for the result). ``seq_lens`` counts every token of the
sequence whose K/V is in the cache *including* the new tokens of this step.
"""

from __future__ import annotations

import torch


def _kv_positions_mask(seq_lens: torch.Tensor, num_slots: int, sliding_window: int | None) -> torch.Tensor:
    """True where a cached position must be hidden from a decode query (beyond length / outside window)."""
    pos = torch.arange(num_slots, device=seq_lens.device)
    lens = seq_lens.to(torch.long)[:, None]
    mask = pos[None, :] >= lens
    if sliding_window is not None:
        mask |= pos[None, :] < lens - sliding_window
    return mask  # [num_seqs, num_slots]


def paged_decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence (its last position) attending to all its cached tokens."""
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    num_slots = max_blocks * block_size
    idx = block_tables.to(torch.long)
    k = kv_cache[0][idx].view(num_seqs, num_slots, num_kv_heads, head_dim)  # [B, S, Hkv, D]
    v = kv_cache[1][idx].view(num_seqs, num_slots, num_kv_heads, head_dim)
    q = query.view(num_seqs, num_kv_heads, group, head_dim).float()  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", q, k.float()) * scale  # [B, Hkv, G, S]
    mask = _kv_positions_mask(seq_lens, num_slots, sliding_window)
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v.float())  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: sequence i's queries are rows [q[i], q[i+1])
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached prefix + new tokens
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Variable-length queries (the last ``q_len`` positions of each sequence), causal among themselves,
    attending to the sequence's cached prefix through its block table. Decode rows are q_len == 1."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].to(torch.long)
        k = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [L, Hkv, D]
        v = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[q0:q1].view(q_len, num_kv_heads, group, head_dim).float()  # [Q, Hkv, G, D]
        scores = torch.einsum("qhgd,khd->hgqk", q, k.float()) * scale  # [Hkv, G, Q, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = k_pos > q_pos
        if sliding_window is not None:
            mask |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v.float())  # [Q, Hkv, G, D]
        out[q0:q1] = o.reshape(q_len, num_heads, head_dim).to(query.dtype)
    return out
