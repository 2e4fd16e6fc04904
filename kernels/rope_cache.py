"""Rotary embedding and the KV-cache write in one launch: rope on q and k of this step's tokens, then k
and v stored at their cache slots.

The rotated query comes back as a new ``[num_tokens, num_heads, head_dim]`` tensor. The rotated key goes to
the cache and, when the caller passes ``new_kv`` (a prefill step whose attention is
``kernels.prefill_new_kv``), also into ``new_kv[0]`` beside a copy of the value in ``new_kv[1]``: one buffer,
so the two share strides, each ``[num_tokens, num_kv_heads, head_dim]`` contiguous (the layout the H200 sweep
timed). Without ``new_kv`` (decode) the rotated key lives only in the cache. Inputs may be strided views of the
fused QKV projection output (head_dim contiguous); they are read, never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import (
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    next_pow2,
    require_triton,
    tl,
    triton,
)
from kernels.cache_write import check_cache_inputs, reshape_and_cache_ref
from kernels.rotary import _rotate_heads, check_rotary_inputs, rope_rows, rotary_embedding_ref


def rope_and_cache_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
    new_kv: torch.Tensor | None = None,  # [2, num_tokens, num_kv_heads, head_dim], written in place if given
) -> torch.Tensor:
    """The unfused path: :func:`rotary_embedding_ref`, then :func:`reshape_and_cache_ref` of the rotated key;
    with ``new_kv``, every token's rotated key into ``new_kv[0]`` and its value into ``new_kv[1]`` (padding
    rows too). Returns the rotated query."""
    query, key = rotary_embedding_ref(positions, query, key, cos_sin_cache)
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping)
    if new_kv is not None:
        new_kv[0].copy_(key)
        new_kv[1].copy_(value)
    return query


@triton.jit
def _copy_heads(
    src_ptr, dst_ptr, row, stride_s, stride_sh, stride_d, stride_dh,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Row ``row`` of ``[*, NUM_HEADS, 2 * HALF]`` as its two halves, the same tiles as the rotation (no
    power-of-two head_dim needed), cast on store."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    c = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_HEADS) & (c < HALF)
    src = src_ptr + row * stride_s + h * stride_sh + c
    x1 = tl.load(src, mask=mask)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(src + HALF, mask=mask)
    dst = dst_ptr + row * stride_d + h * stride_dh + c
    tl.store(dst, x1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, x2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_and_cache_kernel(
    positions_ptr, slot_mapping_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    k_new_ptr, v_new_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_qot, stride_qoh,
    stride_cb, stride_ct, stride_ch, stride_nt, stride_nh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, WRITE_NEW_KV: tl.constexpr,
):  # fmt: skip
    """One program per token: rotate its query heads into q_out; unless its slot is -1, rotate its key
    heads straight into the K cache slot and copy its value heads into the V cache slot; with WRITE_NEW_KV,
    also its rotated key and its value into row t of k_new / v_new."""
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
        _copy_heads(v_ptr, v_cache_ptr + dst, t, stride_vt, stride_vh, 0, stride_ch,
                    NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)  # fmt: skip
    if WRITE_NEW_KV:  # every row, padding too: the prefill kernel reads this step's K/V from here
        # the same fp32 rotation and cast as into the cache (its second read of the row comes from L1/L2)
        _rotate_heads(k_ptr, k_new_ptr, t, stride_kt, stride_kh, stride_nt, stride_nh, cos, sin,
                      NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)  # fmt: skip
        _copy_heads(v_ptr, v_new_ptr, t, stride_vt, stride_vh, stride_nt, stride_nh,
                    NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)  # fmt: skip


def rope_and_cache(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
    new_kv: torch.Tensor | None = None,  # [2, num_tokens, num_kv_heads, head_dim], written in place if given
) -> torch.Tensor:
    """Triton version of :func:`rope_and_cache_ref` (rope computed in fp32, cast once on store). Returns the
    rotated query, a new contiguous tensor."""
    require_triton("rope_and_cache")
    check_rotary_inputs(positions, query, key, cos_sin_cache)
    check_cache_inputs(key, value, kv_cache, slot_mapping)  # key in both checks: all on one device
    if new_kv is not None:
        _check_new_kv_out(new_kv, key)
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # without new_kv the kernel never touches k_new / v_new (WRITE_NEW_KV is a compile-time False): the cache
    # halves stand in, so the decode launch is the one it was
    k_new, v_new = (new_kv[0], new_kv[1]) if new_kv is not None else (k_cache, v_cache)
    _rope_and_cache_kernel[(num_tokens,)](
        positions, slot_mapping, query, key, value, cos_sin_cache, q_out, k_cache, v_cache, k_new, v_new,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_new.stride(0), k_new.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_heads),
        KV_HEADS_PAD=next_pow2(num_kv_heads), HALF=half, HALF_PAD=next_pow2(half), BLOCK_SIZE=block_size,
        WRITE_NEW_KV=new_kv is not None, num_warps=4,
    )  # fmt: skip
    return q_out


def _check_new_kv_out(new_kv: torch.Tensor, key: torch.Tensor) -> None:
    want = (2, *key.shape)
    if tuple(new_kv.shape) != want:
        raise ValueError(
            f"new_kv must be [2, num_tokens, num_kv_heads, head_dim] = {list(want)}, got {list(new_kv.shape)}"
        )
    check_float("new_kv", new_kv)
    check_last_dim_contiguous("new_kv", new_kv)
    check_same_device(key=key, new_kv=new_kv)


@dataclass(frozen=True)
class DecodeRope:
    """What the decode kernel needs to rotate and store the step's new token itself."""

    positions: torch.Tensor  # [num_seqs] int64: the new token's position
    key: torch.Tensor  # [num_seqs, num_kv_heads, head_dim], not rotated
    value: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor  # [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:]
    slot_mapping: torch.Tensor  # [num_seqs] int64: the new token's cache slot; -1 = padding, not written


@triton.jit
def store_new_kv(
    kn_ptr, vn_ptr, k_ptr, v_ptr, src, dst, d, d_mask, cos_sin_ptr, pos, stride_cs, HALF: tl.constexpr,
):  # fmt: skip
    """The new token's key (rotated) and value of one KV head, from element offset ``src`` of the raw
    tensors into element offset ``dst`` of the K and V caches."""
    one = tl.full([1], 0, tl.int64) + src
    k = rope_rows(kn_ptr, one, one >= 0, d, d_mask, cos_sin_ptr, pos, stride_cs, HALF)  # [1, D]
    tl.store(k_ptr + dst + d[None, :], k.to(k_ptr.dtype.element_ty), mask=d_mask[None, :])
    v = tl.load(vn_ptr + src + d, mask=d_mask, other=0.0)
    tl.store(v_ptr + dst + d, v.to(v_ptr.dtype.element_ty), mask=d_mask)
