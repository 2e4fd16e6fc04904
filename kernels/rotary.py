"""Rotary position embedding, neox style (rotate halves), from a precomputed cos/sin cache.

Rope scaling (linear, dynamic-free Llama 3, YaRN-free) is folded into the cache by the model layer;
the kernel only applies it.
"""

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


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, row, stride_s, stride_sh, stride_d, stride_dh, cos, sin,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, HEADS_PAD)[:, None]
    c = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_HEADS) & (c < HALF)
    src = src_ptr + row * stride_s + h * stride_sh + c
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + row * stride_d + h * stride_dh + c
    tl.store(dst, _rotate(x1, cos, x2, -sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, _rotate(x2, cos, x1, sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x, cos, partner, signed_sin):
    """``x * cos + partner * signed_sin`` as one fma after one rounded product, spelled out: left to ptxas, the
    contraction depends on the kernel around it, and the decode kernel's rotated keys (kernels.decode_rope)
    differed from rope_and_cache's by a bf16 ulp in ~1 of 65k elements on the H200 (2026-12-04)."""
    return tl.fma(x, cos, partner * signed_sin)


@triton.jit
def rope_rows(ptr, rows, row_mask, d, d_mask, cos_sin_ptr, pos, stride_cs, HALF: tl.constexpr):
    """``[R, D]`` fp32: rows at element offsets ``rows`` of a head_dim-contiguous tensor, rotated at
    position ``pos`` as ``kernels.rotary._rotate_heads`` rotates them, to the bit: lane ``d < HALF`` is
    ``x1 * cos - x2 * sin``, lane ``d >= HALF`` is ``x2 * cos + x1 * sin`` (each lane's partner loaded;
    both through :func:`_rotate`)."""
    c = d % HALF
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    cs = cos_sin_ptr + pos * stride_cs + c
    cos = tl.load(cs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    mask = row_mask[:, None] & d_mask[None, :]
    a = tl.load(ptr + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(ptr + rows[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return _rotate(a, cos, b, tl.where(d[None, :] < HALF, -sin, sin))


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, stride_qot, stride_qoh, stride_kot, stride_koh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + c, mask=c < HALF, other=0.0).to(tl.float32)  # [1, HALF_PAD]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)  # fmt: skip


def check_rotary_inputs(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """The shape, dtype and stride checks of the rotary kernels (here and in ``kernels.rope_cache``)."""
    check_float("query", query)
    check_float("key", key)
    check_float("cos_sin_cache", cos_sin_cache)
    check_index("positions", positions, 1)
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            f"query and key must be [num_tokens, heads, head_dim], got {tuple(query.shape)}, {tuple(key.shape)}"
        )
    num_tokens, _, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)}, query {tuple(query.shape)}, key {tuple(key.shape)} disagree"
        )
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_positions, {head_dim}] with even head_dim, got {tuple(cos_sin_cache.shape)}"
        )
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rotary_embedding_ref`: returns new rotated (query, key), computed in fp32."""
    require_triton("rotary_embedding")
    check_rotary_inputs(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    if num_tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos_sin_cache, q_out, k_out,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_heads),
            KV_HEADS_PAD=next_pow2(num_kv_heads), HALF=half, HALF_PAD=next_pow2(half), num_warps=4,
        )  # fmt: skip
    return q_out, k_out
