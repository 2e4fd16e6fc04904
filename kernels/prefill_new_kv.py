"""Prefill / chunked-prefill attention that reads this step's keys and values from the contiguous
``[num_tokens, num_kv_heads, head_dim]`` tensors the layer just computed, and only the cached prefix
through the block table.

Below the causal diagonal a tile of new keys is ``BLOCK_N`` consecutive rows of one tensor, so on Hopper it
comes by TMA (a host tensor descriptor: one bulk copy per tile, no per-row addresses, deeper pipelines in
shared memory), where the paged kernel (``kernels.prefill_attention``) gathers every tile page by page
through the block table with per-row pointer loads. The cached prefix and the diagonal tiles still take
pointer loads; the portable pointer path (``use_tma=False``, and any GPU before sm_90) is the same kernel.
The key and value must be the ones written into the cache at this step's slots (rotated key included):
:func:`prefill_attention_new_kv_ref` is the paged reference with them written in. The engine's prefill steps get
them from the fused rotary + cache write (``kernels.rope_cache``, its ``new_kv`` output).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from kernels._triton import next_pow2, require_triton, tl, triton
from kernels.attention_launch import _dot_precision, _upcast, output_like
from kernels.paged_attention import _LOG2E, _load_kv_tile, _online_softmax_step
from kernels.prefill_attention import (
    _MAX_GRID_Y,
    _SHAPE_ARGS,
    _query_tile,
    _unmasked_step,
    check_prefill_inputs,
    paged_prefill_attention_ref,
    store_rows,
)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - no Triton, or one older than 3.4: the pointer path only
    TensorDescriptor = None

# Its tile, as the H200 sweep chose it (``python -m loadtest.kernels_bench --sweep --only prefill``, 2026-12-01,
# commit 08973e7; 8B heads, bf16): ``new_kv_tma_m128_bn128_w8_s3`` (128 rows x 128 keys, 8 warps = two
# warpgroups of wgmma, 3 stages, TMA on sm_90+) reached 461 / 539 / 390 TFLOP/s at 4k causal / 8k causal / 2k
# new after 2k cached, against SDPA's 536 / 617 / 282 (0.86 / 0.87 / 1.38x) and the paged kernel's 335 / 377 /
# 323; ``new_kv_tma_m64_w4_s3`` 472 / 492 / 379 won only at 4k.
NEW_KV_BLOCK_M = 128
NEW_KV_BLOCK_N = 128
NEW_KV_NUM_WARPS = 8
NEW_KV_NUM_STAGES = 3
# That tile's pipelined K/V stages and Q in shared memory at head_dim 128, 2-byte elements (224 KiB of the
# H200's 227): a default launch whose head_dim or dtype needs more (fp32 at 128, head_dim 256) takes 64-key
# tiles, then 2 stages, instead of failing to compile for lack of shared memory.
_SMEM_BUDGET = (2 * NEW_KV_NUM_STAGES * NEW_KV_BLOCK_N + NEW_KV_BLOCK_M) * 128 * 2


def prefill_attention_new_kv_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys (rotated), row for row with query
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: the cached prefixes
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached prefix + new tokens
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """:func:`paged_prefill_attention_ref` over a copy of the cache with ``key`` / ``value`` written at the
    new tokens' slots (whatever the cache held there)."""
    cache = kv_cache.clone()
    block_size = kv_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        pos = torch.arange(seq_len - (q1 - q0), seq_len, device=kv_cache.device)
        blocks = block_tables[i].to(torch.long)[pos // block_size]
        cache[0, blocks, pos % block_size] = key[q0:q1]
        cache[1, blocks, pos % block_size] = value[q0:q1]
    return paged_prefill_attention_ref(query, cache, block_tables, query_start_loc, seq_lens, scale, sliding_window)


@triton.jit
def _load_split_kv(
    k_ptr, v_ptr, bt_row, kn_ptr, vn_ptr, pos, pos_ok, context_len, new_row0, d, d_mask, kvh,
    stride_kb, stride_kt, stride_kh, stride_nt, stride_nh, BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """K and V ``[BLOCK_N, D]`` at positions ``pos`` (only where ``pos_ok``): the cached prefix through the
    block table, the new tokens (``pos >= context_len``) from rows ``new_row0 + pos - context_len``. One
    load per tensor from per-row pointers into either source, so a tile costs no more registers than a
    paged one (two masked loads merged by a select held both tiles: 128 x 128 tiles spilled)."""
    in_new = pos >= context_len
    block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok & ~in_new, other=0).to(tl.int64)
    cache_off = block_ids * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kvh * stride_kh  # [BLOCK_N]
    new_off = (new_row0 + pos - context_len).to(tl.int64) * stride_nt + kvh * stride_nh
    k_rows = tl.where(in_new, kn_ptr + new_off, k_ptr + cache_off)
    v_rows = tl.where(in_new, vn_ptr + new_off, v_ptr + cache_off)
    mask = pos_ok[:, None] & d_mask[None, :]
    k = tl.load(k_rows[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_rows[:, None] + d[None, :], mask=mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _new_rows(
    ptr, desc, row, kvh, d, d_mask, stride_nt, stride_nh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Rows ``row .. row + BLOCK_N`` (all inside the tensor) of KV head ``kvh`` of a new-token tensor."""
    if USE_TMA:
        x = desc.load([row, kvh * HEAD_DIM])
    else:
        offs = ((row + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_nt + kvh * stride_nh)[:, None] + d[None, :]
        x = tl.load(ptr + offs, mask=d_mask[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _new_kv_loop(
    q, m_i, l_i, acc, kn_ptr, vn_ptr, kn_desc, vn_desc, row, num_tiles, kvh, d, d_mask, stride_nt, stride_nh,
    scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """``num_tiles`` unmasked tiles of new keys from row ``row`` on.

    Two Hopper overlaps were tried here and compiled for sm_90 with Triton 3.6 (the TTGIR read): the next
    tile's QK^T issued before this tile's softmax (FlashAttention-3's intra-warpgroup overlap) gets a
    ``warp_group_dot_wait {pendings = 0}`` right after it, so nothing overlaps; and
    ``tl.range(warp_specialize=True)`` leaves one partition (its automatic warp specialization is
    Blackwell's). Neither is a knob."""
    for _ in range(0, num_tiles):
        k = _new_rows(kn_ptr, kn_desc, row, kvh, d, d_mask, stride_nt, stride_nh, HEAD_DIM, BLOCK_N, USE_TMA, UPCAST)
        v = _new_rows(vn_ptr, vn_desc, row, kvh, d, d_mask, stride_nt, stride_nh, HEAD_DIM, BLOCK_N, USE_TMA, UPCAST)
        m_i, l_i, acc = _unmasked_step(q, k, v, m_i, l_i, acc, scale_log2, DOT_PRECISION)
        row += BLOCK_N
    return m_i, l_i, acc


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _prefill_new_kv_kernel(
    q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, kn_desc, vn_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, scale_log2, sliding_window, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_nt, stride_nh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, LARGEST_FIRST: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, SKIP_DECODE_ROWS: tl.constexpr,
):  # fmt: skip
    kvh, seq, q_start, q_tile_start, context_len, kv_hi, heads, q_rows, q_pos, row_mask, d, d_mask, q = _query_tile(
        q_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, stride_qt, stride_qh, GROUP, GROUP_PAD, HEAD_DIM,
        HEAD_DIM_PAD, BLOCK_Q, LARGEST_FIRST, HEAD_MAJOR, SKIP_DECODE_ROWS, UPCAST,
    )  # fmt: skip
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    if USE_WINDOW:  # every tile masked, from the window's first key on (as the paged kernel does)
        masked_start = (tl.maximum(context_len + q_tile_start - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        # keys before the tile's first query are visible to all its rows: three unmasked loops, by source
        masked_start = (tl.minimum(context_len + q_tile_start, kv_hi) // BLOCK_N) * BLOCK_N
        cached_end = tl.minimum((context_len // BLOCK_N) * BLOCK_N, masked_start)  # whole tiles of the prefix
        new_start = tl.minimum(tl.cdiv(context_len, BLOCK_N) * BLOCK_N, masked_start)  # whole tiles of new keys
        for start in range(0, cached_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k, v = _load_kv_tile(k_ptr, v_ptr, bt_row, pos, pos, d, d_mask, kvh, stride_kb, stride_kt, stride_kh,
                                 BLOCK_SIZE, False, UPCAST)  # fmt: skip
            m_i, l_i, acc = _unmasked_step(q, k, v, m_i, l_i, acc, scale_log2, DOT_PRECISION)
        for start in range(cached_end, new_start, BLOCK_N):  # at most one tile: the prefix ends inside it
            pos = start + tl.arange(0, BLOCK_N)
            k, v = _load_split_kv(k_ptr, v_ptr, bt_row, kn_ptr, vn_ptr, pos, pos >= 0, context_len, q_start, d,
                                  d_mask, kvh, stride_kb, stride_kt, stride_kh, stride_nt, stride_nh, BLOCK_SIZE,
                                  UPCAST)  # fmt: skip
            m_i, l_i, acc = _unmasked_step(q, k, v, m_i, l_i, acc, scale_log2, DOT_PRECISION)
        m_i, l_i, acc = _new_kv_loop(
            q, m_i, l_i, acc, kn_ptr, vn_ptr, kn_desc, vn_desc, q_start + new_start - context_len,
            (masked_start - new_start) // BLOCK_N, kvh, d, d_mask, stride_nt, stride_nh, scale_log2,
            HEAD_DIM, BLOCK_N, USE_TMA, DOT_PRECISION, UPCAST,
        )  # fmt: skip
    for start in range(masked_start, kv_hi, BLOCK_N):  # the diagonal (and window edge): masked
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        k, v = _load_split_kv(k_ptr, v_ptr, bt_row, kn_ptr, vn_ptr, pos, pos_ok, context_len, q_start, d, d_mask,
                              kvh, stride_kb, stride_kt, stride_kh, stride_nt, stride_nh, BLOCK_SIZE, UPCAST)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, BLOCK_N]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, True, DOT_PRECISION)
    store_rows(out_ptr, acc, l_i, q_rows, heads, d, row_mask, d_mask, stride_ot, stride_oh)


def prefill_attention_new_kv(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys as written into the cache
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached prefix + new tokens
    scale: float,
    sliding_window: int | None = None,
    skip_decode_rows: bool = False,  # one-token sequences' rows left unwritten (kernels.paged_attention's then)
    out: torch.Tensor | None = None,  # written in place (skipped rows left as they are)
) -> torch.Tensor:
    """Triton version of :func:`prefill_attention_new_kv_ref`."""
    return _prefill_attention_new_kv(
        query, key, value, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
        skip_decode_rows=skip_decode_rows, out=out,
    )  # fmt: skip


def _prefill_attention_new_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    block_m: int = NEW_KV_BLOCK_M,
    block_n: int | None = None,  # None: NEW_KV_BLOCK_N, or what fits (default_kv_tile)
    num_warps: int = NEW_KV_NUM_WARPS,
    num_stages: int | None = None,  # None: NEW_KV_NUM_STAGES, or what fits
    use_tma: bool | None = None,  # None: where the GPU and the tensors allow it (can_use_tma)
    largest_first: bool = True,
    head_major: bool = False,  # with largest_first: the grid by KV head (_program_tile)
    skip_decode_rows: bool = False,  # one-token sequences' rows are left unwritten (paged_decode_rows' then)
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    require_triton("prefill_attention_new_kv")
    check_prefill_inputs(query, kv_cache, block_tables, query_start_loc, seq_lens, sliding_window)
    _check_new_kv(query, key, value, kv_cache, scale)
    fit_n, fit_stages = default_kv_tile(query.shape[2], query.element_size(), block_m, _smem_budget(query.device))
    block_n = fit_n if block_n is None else block_n
    num_stages = fit_stages if num_stages is None else num_stages
    tma_ok = can_use_tma(key, value, block_n)
    if use_tma and not tma_ok:
        raise ValueError("use_tma: needs Triton tensor descriptors, sm_90+ or the interpreter, head_dim a power "
                         "of two, the heads of a row adjacent and 16-byte aligned rows")  # fmt: skip
    use_tma = tma_ok if use_tma is None else use_tma
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = max(1, block_m // group_pad)
    out = output_like(query, out)
    if num_tokens == 0 or num_seqs == 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kn_desc, vn_desc = _new_kv_descriptors(key, value, block_n) if use_tma else (key, value)
    num_tiles = num_tokens // block_q + num_seqs  # bound on sum(cdiv(q_len, block_q)); no device sync
    head_major = head_major and largest_first
    largest_first = largest_first and (head_major or num_tiles < _MAX_GRID_Y)
    grid = (num_kv_heads, num_tiles) if largest_first and not head_major else (num_tiles, num_kv_heads)
    _prefill_new_kv_kernel[grid](
        query, k_cache, v_cache, key, value, kn_desc, vn_desc, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, sliding_window or 0, num_seqs,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        key.stride(0), key.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n, USE_WINDOW=sliding_window is not None,
        USE_TMA=use_tma, DOT_PRECISION=_dot_precision(query),
        UPCAST=_upcast(query), LARGEST_FIRST=largest_first, HEAD_MAJOR=head_major,
        SKIP_DECODE_ROWS=skip_decode_rows,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _new_kv_descriptors(key: torch.Tensor, value: torch.Tensor, block_n: int) -> tuple[Any, Any]:
    """TMA descriptors of the step's new keys and values: ``[num_tokens, num_kv_heads * head_dim]`` rows, a tile
    ``BLOCK_N`` rows of one head's columns."""
    num_tokens, num_kv_heads, head_dim = key.shape
    flat = [num_tokens, num_kv_heads * head_dim]
    return (
        TensorDescriptor(key, flat, [key.stride(0), 1], [block_n, head_dim]),
        TensorDescriptor(value, flat, [value.stride(0), 1], [block_n, head_dim]),
    )


def default_kv_tile(
    head_dim: int, element_size: int, block_m: int = NEW_KV_BLOCK_M, smem_budget: int = _SMEM_BUDGET
) -> tuple[int, int]:
    """``(block_n, num_stages)`` of a default launch: the sweep's, or with fewer keys per tile and then fewer
    stages where the K/V stages and Q would need more shared memory than ``smem_budget`` (shapes only)."""
    d = max(16, next_pow2(head_dim))
    for block_n, num_stages in ((NEW_KV_BLOCK_N, NEW_KV_NUM_STAGES), (64, NEW_KV_NUM_STAGES), (64, 2), (32, 2)):
        if (2 * num_stages * block_n + block_m) * d * element_size <= smem_budget:
            break
    return block_n, num_stages


@cache
def _smem_budget(device: torch.device) -> int:
    """``_SMEM_BUDGET``, or less on a GPU whose blocks get less shared memory than the H200's (A100: 163 KiB)."""
    if device.type != "cuda":
        return _SMEM_BUDGET
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", _SMEM_BUDGET)
    return min(_SMEM_BUDGET, int(optin))


def can_use_tma(key: torch.Tensor, value: torch.Tensor, block_n: int) -> bool:
    """Whether the new tensors can be read by TMA: Triton's host tensor descriptors, a Hopper-or-later GPU
    (or the CPU interpreter), a power-of-two head_dim (the box covers exactly one head), a row's heads side
    by side and 16-byte aligned rows and base addresses."""
    if TensorDescriptor is None:
        return False
    if key.device.type == "cuda" and torch.cuda.get_device_capability(key.device)[0] < 9:
        return False
    head_dim, size = key.shape[2], key.element_size()
    return all(
        t.stride(1) == head_dim
        and (t.stride(0) * size) % 16 == 0
        and t.data_ptr() % 16 == 0
        and head_dim & (head_dim - 1) == 0
        and head_dim >= 16
        and block_n <= 256
        for t in (key, value)
    )


def _check_new_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, scale: float
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    want = (query.shape[0], num_kv_heads, head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim] = {list(want)}, got {list(t.shape)}")
        if t.dtype != query.dtype or t.device != query.device:
            raise ValueError(f"{name} must be {query.dtype} on {query.device}, got {t.dtype} on {t.device}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    if key.stride() != value.stride():
        raise ValueError(f"key and value need the same strides, got {key.stride()} and {value.stride()}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0 (it is folded into the softmax's max), got {scale}")
