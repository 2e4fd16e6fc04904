"""Rotary embedding and the KV-cache write in one launch: rope on q and k of this step's tokens, then k
and v stored at their cache slots.

The attention kernels read K from the cache only, so the rotated key is never materialized outside it;
the rotated query comes back as a new ``[num_tokens, num_heads, head_dim]`` tensor. Inputs may be strided
views of the fused QKV projection output (head_dim contiguous).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require_triton, tl, triton
from kernels.cache_write import check_cache_inputs, reshape_and_cache_ref
from kernels.rotary import _rotate_heads, check_rotary_inputs, rotary_embedding_ref


def rope_and_cache_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
) -> torch.Tensor:
    """The unfused path: :func:`rotary_embedding_ref`, then :func:`reshape_and_cache_ref` of the rotated key.
    Returns the rotated query."""
    query, key = rotary_embedding_ref(positions, query, key, cos_sin_cache)
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping)
    return query


@triton.jit
def _rope_and_cache_kernel(
    positions_ptr, slot_mapping_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_qot, stride_qoh,
    stride_cb, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """One program per token: rotate its query heads into q_out; unless its slot is -1, rotate its key
    heads straight into the K cache slot and copy its value heads into the V cache slot."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + c, mask=c < HALF, other=0.0).to(tl.float32)  # [1, HALF_PAD]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)  # fmt: skip
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:  # -1 marks padding tokens
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        # row stride 0: the destination of this token's key is the slot itself
        _rotate_heads(k_ptr, k_cache_ptr + dst, t, stride_kt, stride_kh, 0, stride_ch, cos, sin,
                      NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)  # fmt: skip
        h = tl.arange(0, KV_HEADS_PAD)[:, None]
        # the value row as its two halves, the same tiles as the key (no power-of-two head_dim needed)
        mask = (h < NUM_KV_HEADS) & (c < HALF)
        src = v_ptr + t * stride_vt + h * stride_vh + c
        v1 = tl.load(src, mask=mask)  # [KV_HEADS_PAD, HALF_PAD]
        v2 = tl.load(src + HALF, mask=mask)
        out = v_cache_ptr + dst + h * stride_ch + c
        tl.store(out, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rope_and_cache(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
) -> torch.Tensor:
    """Triton version of :func:`rope_and_cache_ref` (rope computed in fp32, cast once on store). Returns the
    rotated query, a new contiguous tensor."""
    require_triton("rope_and_cache")
    check_rotary_inputs(positions, query, key, cos_sin_cache)
    check_cache_inputs(key, value, kv_cache, slot_mapping)  # key in both checks: all on one device
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rope_and_cache_kernel[(num_tokens,)](
        positions, slot_mapping, query, key, value, cos_sin_cache, q_out, k_cache, v_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_heads),
        KV_HEADS_PAD=next_pow2(num_kv_heads), HALF=half, HALF_PAD=next_pow2(half), BLOCK_SIZE=block_size,
        num_warps=4,
    )  # fmt: skip
    return q_out
