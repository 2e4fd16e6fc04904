"""Paged prefill / chunked-prefill attention: variable-length queries (``query_start_loc``), causal among
the new tokens, attending to each sequence's cached prefix through its block table. Decode rows (q_len 1)
may share the launch. Layout and conventions as in ``kernels.paged_attention``."""

from __future__ import annotations

import torch

from kernels._triton import check_index, check_same_device, next_pow2, require_triton, tl, triton
from kernels.attention_launch import _check_attention_inputs, _dot_precision, _upcast
from kernels.paged_attention import _LOG2E, _load_kv_tile, _online_softmax_step


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


# ---------------------------------------------------------------------------------------------------------
# Triton: prefill / chunked prefill / mixed batches. Grid (q_tile, kv_head). Sequence s owns the tiles
# [q_start[s] // BLOCK_Q + s, q_start[s + 1] // BLOCK_Q + s + 1): a bound on its cdiv(q_len, BLOCK_Q) tiles
# that needs no device sync, found back by binary search over query_start_loc. A tile is BLOCK_Q query
# tokens x the GROUP query heads of one KV head, flattened into BLOCK_Q * GROUP_PAD rows (GQA).


@triton.jit
def _locate_tile(tile, query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr, SKIP_DECODE_ROWS: tl.constexpr):
    """The sequence that owns query tile ``tile``, its first query row and length, and the tile's first
    token among the sequence's new tokens (past q_len: an idle tile of the bound). SKIP_DECODE_ROWS: a sequence
    with one new token reads as none (its row is the decode kernel's: kernels.paged_attention.paged_decode_rows)."""
    lo = 0
    hi = num_seqs
    while hi - lo > 1:  # largest s with q_start[s] // BLOCK_Q + s <= tile
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile_start = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if SKIP_DECODE_ROWS:
        q_len = tl.where(q_len == 1, 0, q_len)
    return seq, q_start, q_len, q_tile_start


@triton.jit
def _program_tile(LARGEST_FIRST: tl.constexpr, HEAD_MAJOR: tl.constexpr):
    """(query tile, kv head) of this program. LARGEST_FIRST: grid (kv_head, tile) walked from the last tile,
    so the longest causal rows start first and the short ones fill the tail, or with HEAD_MAJOR grid (tile,
    kv_head) walked from the last tile (the programs resident at once share one head's K/V in L2); else grid
    (tile, kv_head)."""
    if LARGEST_FIRST and HEAD_MAJOR:
        return tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    elif LARGEST_FIRST:
        return tl.num_programs(1) - 1 - tl.program_id(1), tl.program_id(0)
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def _unmasked_step(q, k, v, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One KV tile that every row sees (scores all finite): the scale folded into the exponent's FMA and
    the PV product accumulated in place, as in the Triton tutorial's kernel (scale_log2 > 0)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _query_tile(
    q_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, stride_qt, stride_qh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, LARGEST_FIRST: tl.constexpr, HEAD_MAJOR: tl.constexpr, SKIP_DECODE_ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """This program's query tile, as both prefill kernels begin: its KV head and sequence, where the tile starts,
    the cached tokens before the step's queries, the causal end of its keys (``kv_hi``, 0 for a spare tile), and its
    rows (query tokens x the GQA group's heads: head, query row, absolute position, mask), head dims and queries."""
    tile, kvh = _program_tile(LARGEST_FIRST, HEAD_MAJOR)
    seq, q_start, q_len, q_tile_start = _locate_tile(tile, query_start_loc_ptr, num_seqs, BLOCK_Q, SKIP_DECODE_ROWS)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached tokens before this step's queries
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_tile_start + r // GROUP_PAD  # [M] index among the sequence's new tokens
    g = r % GROUP_PAD
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    row_mask = (tok < q_len) & (g < GROUP)
    heads = kvh * GROUP + g
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + tok  # [M] absolute positions
    kv_hi = tl.minimum(context_len + q_tile_start + BLOCK_Q, seq_len)  # causal: up to the tile's last query
    kv_hi = tl.where(q_tile_start < q_len, kv_hi, 0)  # a spare tile of the grid's bound: nothing to read
    return kvh, seq, q_start, q_tile_start, context_len, kv_hi, heads, q_rows, q_pos, row_mask, d, d_mask, q


@triton.jit
def store_rows(out_ptr, acc, l_i, q_rows, heads, d, row_mask, d_mask, stride_ot, stride_oh):
    """The tile's output rows: the online softmax's ``acc / l`` (0 where a row saw no key)."""
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# Arguments that change from step to step (the batch's sequences, its block table's width): Triton would compile
# one variant per "1 / divisible by 16 / other" of each, and a step whose pattern the warm-up missed compiled it
# inside a request (the H200 suite's first mixed-128: 10.5 s against 5.4 s, two new_kv variants, 2026-12-02).
_SHAPE_ARGS = ["sliding_window", "num_seqs", "stride_bt"]


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale_log2, sliding_window, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    SPLIT_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, LARGEST_FIRST: tl.constexpr,
    FMA_SOFTMAX: tl.constexpr, SKIP_DECODE_ROWS: tl.constexpr,
):  # fmt: skip
    kvh, seq, q_start, q_tile_start, context_len, kv_hi, heads, q_rows, q_pos, row_mask, d, d_mask, q = _query_tile(
        q_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, stride_qt, stride_qh, GROUP, GROUP_PAD, HEAD_DIM,
        HEAD_DIM_PAD, BLOCK_Q, LARGEST_FIRST, False, SKIP_DECODE_ROWS, UPCAST,
    )  # fmt: skip
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context_len + q_tile_start - sliding_window + 1, 0)
    bt_row = block_tables_ptr + seq * stride_bt
    masked_start = (kv_lo // BLOCK_N) * BLOCK_N
    if SPLIT_MASK:  # (never with a window) keys before the tile's first query are visible to all its rows
        masked_start = (tl.minimum(context_len + q_tile_start, kv_hi) // BLOCK_N) * BLOCK_N
        for start in range(0, masked_start, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k, v = _load_kv_tile(k_ptr, v_ptr, bt_row, pos, pos, d, d_mask, kvh, stride_kb, stride_kt, stride_kh,
                                 BLOCK_SIZE, False, UPCAST)  # fmt: skip
            if FMA_SOFTMAX:
                m_i, l_i, acc = _unmasked_step(q, k, v, m_i, l_i, acc, scale_log2, DOT_PRECISION)
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, BLOCK_N], all finite
                m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, False, DOT_PRECISION)
    for start in range(masked_start, kv_hi, BLOCK_N):  # the diagonal (and window edge): masked
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        k, v = _load_kv_tile(k_ptr, v_ptr, bt_row, pos, pos_ok, d, d_mask, kvh, stride_kb, stride_kt, stride_kh,
                             BLOCK_SIZE, True, UPCAST)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, BLOCK_N]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, True, DOT_PRECISION)
    store_rows(out_ptr, acc, l_i, q_rows, heads, d, row_mask, d_mask, stride_ot, stride_oh)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached prefix + new tokens
    scale: float,
    sliding_window: int | None = None,
    skip_decode_rows: bool = False,  # one-token sequences' rows left unwritten (kernels.paged_attention's then)
) -> torch.Tensor:
    """Triton version of :func:`paged_prefill_attention_ref`."""
    return _paged_prefill_attention(
        query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
        skip_decode_rows=skip_decode_rows,
    )  # fmt: skip


# The paged kernel's tile, as the H200 sweep last chose it (``python -m loadtest.kernels_bench --sweep --only
# prefill`` decides; 2026-11-29: 64 rows x 4 warps beat 128 x 8 at 4k tokens, 268 vs 231 TFLOP/s, before the
# unmasked/diagonal split). Rows are query tokens x the GQA group's heads.
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2
PREFILL_LARGEST_FIRST = False
PREFILL_FMA_SOFTMAX = False
_MAX_GRID_Y = 65536  # CUDA's grid limit on axis 1: more tiles take the (tile, kv_head) order


def _paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int = PREFILL_BLOCK_N,
    num_warps: int = PREFILL_NUM_WARPS,
    num_stages: int = PREFILL_NUM_STAGES,
    split_mask: bool = True,  # an unmasked loop below the causal diagonal, masks only on the diagonal tiles
    largest_first: bool = PREFILL_LARGEST_FIRST,  # launch the longest causal tiles first (see _program_tile)
    fma_softmax: bool = PREFILL_FMA_SOFTMAX,  # below the diagonal: _unmasked_step (needs scale > 0)
    skip_decode_rows: bool = False,  # one-token sequences' rows are left unwritten (paged_decode_rows' then)
) -> torch.Tensor:
    require_triton("paged_prefill_attention")
    check_prefill_inputs(query, kv_cache, block_tables, query_start_loc, seq_lens, sliding_window)
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = max(1, block_m // group_pad)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_tiles = num_tokens // block_q + num_seqs  # bound on sum(cdiv(q_len, block_q)); no device sync
    largest_first = largest_first and num_tiles < _MAX_GRID_Y
    grid = (num_kv_heads, num_tiles) if largest_first else (num_tiles, num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, sliding_window or 0, num_seqs,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n, USE_WINDOW=sliding_window is not None,
        SPLIT_MASK=split_mask and sliding_window is None, DOT_PRECISION=_dot_precision(query), UPCAST=_upcast(query),
        LARGEST_FIRST=largest_first, FMA_SOFTMAX=fma_softmax and scale > 0, SKIP_DECODE_ROWS=skip_decode_rows,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def check_prefill_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """The shape, dtype and layout checks of every prefill wrapper (ValueError with what to fix)."""
    _check_attention_inputs(query, kv_cache, block_tables, seq_lens)
    check_index("query_start_loc", query_start_loc, 1)
    check_same_device(query=query, query_start_loc=query_start_loc)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"query_start_loc needs num_seqs + 1 = {seq_lens.shape[0] + 1} entries, got {query_start_loc.shape[0]}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
