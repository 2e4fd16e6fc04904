"""Scatter this step's K/V into the paged cache by slot (slot = block_id * block_size + offset)."""

from __future__ import annotations

import torch

from kernels._triton import (
    check_float,
    check_index,
    check_last_dim_contiguous,
    check_same_device,
    next_pow2,
    require_triton,
    tl,
    triton,
)


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


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """One program per token: copy its [num_kv_heads, head_dim] K and V rows to the cache slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:  # -1 marks padding tokens
        h = tl.arange(0, HEADS_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h[:, None] * stride_ch + d[None, :]
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_cache_inputs(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The shape, dtype and stride checks of the cache-write kernels (here and in ``kernels.rope_cache``)."""
    check_float("key", key)
    check_float("value", value)
    check_float("kv_cache", kv_cache)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}")
        check_last_dim_contiguous(name, t)
    check_last_dim_contiguous("kv_cache", kv_cache)
    check_index("slot_mapping", slot_mapping, 1)
    if not key.shape[0] == value.shape[0] == slot_mapping.shape[0]:
        raise ValueError(
            f"key, value and slot_mapping disagree on num_tokens: {key.shape[0]}, {value.shape[0]}, {slot_mapping.shape[0]}"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
) -> None:
    """Triton version of :func:`reshape_and_cache_ref`. ``key``/``value`` may be strided views (e.g. slices
    of a fused QKV output) as long as head_dim is contiguous."""
    require_triton("reshape_and_cache")
    check_cache_inputs(key, value, kv_cache, slot_mapping)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.shape[0] == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM_PAD=next_pow2(head_dim), BLOCK_SIZE=block_size, num_warps=4,
    )  # fmt: skip
