"""Paged attention over the KV cache layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

Block tables are ``[num_seqs, max_blocks_per_seq]`` int32, padded with 0 (a valid block id; entries
past a sequence's length are never read for the result). ``seq_lens`` counts every token of the
sequence whose K/V is in the cache *including* the new tokens of this step.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kernels._triton import next_pow2, require_triton, tl, triton
from kernels.attention_launch import _check_attention_inputs, _check_step_rows, _dot_precision, _upcast, output_like
from kernels.decode_merge import _decode_reduce_kernel, _partition_len, _query_row
from kernels.decode_plan import MERGE_CHUNK, num_sms, plan_decode
from kernels.pdl import PDL_MAX_ROWS, launch_dependents, pdl_supported, wait_prior_grids
from kernels.rope_cache import DecodeRope, store_new_kv
from kernels.rotary import rope_rows

# Both decode kernels launched with programmatic dependent launch on sm_90+ (kernels.pdl) for kernels.pdl.PDL_MAX_ROWS
# sequences: each waits for the kernel before first of all, so only its launch overlaps that kernel's end. H200 (895de8b): the int4 8B model at
# batch 1 2.295 ms with it against 2.322 without (the GEMVs and RMSNorm with PDL in both); bf16 see
# kernels.norm.RMS_NORM_PDL. PAGEDSERVE_DECODE_PDL=0 turns it off.
DECODE_PDL = os.environ.get("PAGEDSERVE_DECODE_PDL", "1") != "0"
# Batch-1 decode attention was 8.3 us a layer on an H100 (Session 39: the int4 model 2.295 ms without its launches
# against 2.561), mostly a chain of dependent loads. Both kernels load the step's inputs (sequence length, position,
# slot) before their PDL wait, a round trip off that chain. H100, Sessions 39-40 (int4_model's variant "earlyin",
# five processes, bracketed by the defaults run again late): int4 batch 1 -5 to -17 us a step (2.542-2.548 ms against
# 2.551-2.565), bf16 -23 us (5.663 against 5.686 / 5.688). PAGEDSERVE_DECODE_EARLY_INPUTS=0 turns it off.
# Lost or tied, removed: the first KV tile before the wait too (Session 39, +25 us a step); the one-tile partitions'
# block ids before the wait with programs past the sequence skipping it (Session 40, "earlyids": 2.543 / 2.549
# against earlyin's 2.546 / 2.542); the new token's key and value from registers, so that its store needs no fence
# (Session 40, "newreg": +30 us). (Session 39: taking them into the tile from registers doubled the kernel's shared
# memory at sm_90, 38.9 to 69.6 KB; not measured.)
DECODE_EARLY_INPUTS = os.environ.get("PAGEDSERVE_DECODE_EARLY_INPUTS", "1") != "0"
_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # inline PTX (FENCE) only when compiled


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
    # zero hidden V rows too: stale or never-written slots (torch.empty) may hold NaN, and 0 * NaN = NaN
    v = v.float().masked_fill(mask[:, :, None, None], 0.0)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


# ---------------------------------------------------------------------------------------------------------
# Triton: decode (flash-decoding). Grid (seq, kv_head, partition): one program reads its partition of one
# KV head's cache once and serves all GROUP query heads of that KV head as the rows of a [GROUP_PAD, D]
# tile (GQA). Partitions cut long sequences so that batch 1 still fills the GPU (kernels/decode_plan.py
# sizes them); their (max, sum, output) triples are merged by a second kernel (kernels/decode_merge.py). With one
# partition the first kernel writes the output.


@triton.jit
def _load_kv_tile(
    k_ptr, v_ptr, bt_row, pos, pos_ok, d, d_mask, kvh, stride_kb, stride_kt, stride_kh,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """K and V ``[BLOCK_N, D]`` of one KV head at positions ``pos``, gathered through the block table row.
    MASKED: only positions where ``pos_ok`` are read; otherwise every position is known to be valid."""
    if MASKED:
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_mask = pos_ok[:, None] & d_mask[None, :]
    else:
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    row_off = block_ids * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kvh * stride_kh  # [BLOCK_N]
    k = tl.load(k_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, MAY_BE_EMPTY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` (log2 domain, -inf where hidden) and its values into the running max,
    sum and output. MAY_BE_EMPTY: a row may have seen only hidden keys so far (its max is still -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MAY_BE_EMPTY:  # noqa: SIM108 - a constexpr branch, resolved when the kernel is compiled
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr, part_out_ptr, part_stats_ptr,
    scale_log2, sliding_window,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_os, stride_oh,
    num_partitions, rope_pos_ptr, rope_slot_ptr, cos_sin_ptr, kn_ptr, vn_ptr, stride_cs, stride_nt, stride_nh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, DYNAMIC: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, STEP_ROWS: tl.constexpr, ROPE: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):  # fmt: skip
    """ROPE (``kernels.decode_rope``): q, kn and vn are the step's raw rows; the query is rotated as it is
    loaded, and the program whose partition holds the new token stores its rotated key and value first.
    PDL (launched with ``launch_pdl``, ``kernels.pdl``): waits for the kernel before; with EARLY only after loading
    the step's inputs (its sequence length, position and slot), which no kernel of the step writes: the kernel before
    (the qkv GEMV) waits for its own before it lets this one start, so every kernel before it has completed."""
    if PDL and not EARLY:
        wait_prior_grids()
        launch_dependents()
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row, is_row = _query_row(seq, query_start_loc_ptr, STEP_ROWS)
    if ROPE:
        new_pos = tl.load(rope_pos_ptr + q_row)
        slot = tl.load(rope_slot_ptr + q_row)
    if PDL and EARLY:
        wait_prior_grids()
        launch_dependents()
    part_len = _partition_len(seq_len, num_partitions, PARTITION_SIZE, BLOCK_N, DYNAMIC)
    part_start = part * part_len
    part_end = tl.minimum(part_start + part_len, seq_len)
    kv_lo = part_start
    if USE_WINDOW:
        kv_lo = tl.maximum(part_start, seq_len - sliding_window)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    live = (part_start < seq_len) & is_row  # the tables' width may exceed this sequence: nothing to do past it
    if ROPE:
        q = rope_rows(q_ptr, q_row * stride_qs + heads * stride_qh, g_mask & live, d, d_mask, cos_sin_ptr, new_pos,
                      stride_cs, HEAD_DIM // 2).to(q_ptr.dtype.element_ty)  # fmt: skip
        if live & (part_start <= seq_len - 1) & (seq_len - 1 < part_end) & (slot >= 0):  # the new token's partition
            dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + kvh * stride_kh
            store_new_kv(kn_ptr, vn_ptr, k_ptr, v_ptr, q_row * stride_nt + kvh * stride_nh, dst, d, d_mask,
                         cos_sin_ptr, new_pos, stride_cs, HEAD_DIM // 2)  # fmt: skip
            if FENCE:  # the stores at GPU scope (L2) before the barrier: the tile copies below read L2
                tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)  # fmt: skip
            tl.debug_barrier()  # the stores above are seen by every thread's loads of the tile that holds them
    else:
        q = tl.load(q_ptr + q_row * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :] & live, other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range((kv_lo // BLOCK_N) * BLOCK_N, part_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = (pos < part_end) & (pos >= kv_lo)
        k, v = _load_kv_tile(k_ptr, v_ptr, bt_row, pos, pos_ok, d, d_mask, kvh, stride_kb, stride_kt, stride_kh,
                             BLOCK_SIZE, True, UPCAST)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, True, DOT_PRECISION)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_PARTITION:
        o_ptrs = out_ptr + q_row * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask & live)
    else:
        # [num_seqs, num_heads, num_partitions] scratch rows; partitions past seq_len are never read
        row = (seq * (GROUP * tl.num_programs(1)) + heads) * num_partitions + part  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask & live)
        tl.store(part_stats_ptr + row * 2, m_i, mask=g_mask & live)
        tl.store(part_stats_ptr + row * 2 + 1, l_i, mask=g_mask & live)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim], written in place (a new tensor if None)
) -> torch.Tensor:
    """Triton version of :func:`paged_decode_attention_ref`."""
    return _paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale, sliding_window, out=out)


def paged_decode_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: a mixed step's rows, sequences back to back
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's K/V written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """The decode kernel on the sequences of a mixed step that have one new token (which sequences is read on the
    device, so a CUDA graph serves any mix), their rows of ``out`` written in place and the other rows left as
    they are (the prefill kernel's, with ``skip_decode_rows``). Equals the prefill reference on those rows."""
    return _paged_decode_attention(
        query, kv_cache, block_tables, seq_lens, scale, sliding_window, query_start_loc=query_start_loc, out=out
    )


def _paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_warps: int = 4,
    *,
    reduce_chunk: int = MERGE_CHUNK,  # partitions the second launch's merge loads at once (sweep row auto_rc16)
    query_start_loc: torch.Tensor | None = None,  # [num_seqs + 1]: a mixed step's rows (paged_decode_rows)
    out: torch.Tensor | None = None,  # written in place; with query_start_loc: the step's output, its decode rows
    rope: DecodeRope | None = None,  # query not rotated: the kernel rotates it and stores the new K/V (decode_rope)
    early: bool | None = None,  # inputs loaded before the PDL wait; None: DECODE_EARLY_INPUTS where PDL is on
    **knobs: Any,  # plan_decode's block_n, num_stages, partition_size, dynamic, programs_per_sm; unset: the defaults
) -> torch.Tensor:
    """The wrapper with its tuning knobs exposed (tests force small partitions; the benchmark sweeps)."""
    require_triton("paged_decode_attention")
    _check_attention_inputs(query, kv_cache, block_tables, seq_lens)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs, out = _decode_output(query, seq_lens, query_start_loc, out, rope)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return out
    max_len = block_tables.shape[1] * block_size  # upper bound on seq_lens; no device sync
    plan = plan_decode(num_seqs, num_kv_heads, max_len, num_sms(query.device.index or 0), **knobs)
    num_partitions, single = plan.num_partitions, plan.num_partitions == 1
    # [num_seqs, num_heads, num_partitions, head_dim] partial outputs and (max, sum) pairs, fp32
    part_out = query.new_empty(
        (num_seqs, num_heads, num_partitions, head_dim) if not single else (1,), dtype=torch.float32
    )
    part_stats = query.new_empty((num_seqs, num_heads, num_partitions, 2) if not single else (1,), dtype=torch.float32)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    head_dim_pad = max(16, next_pow2(head_dim))
    pdl = DECODE_PDL and num_seqs <= PDL_MAX_ROWS and pdl_supported(query)
    early = pdl and DECODE_EARLY_INPUTS if early is None else early
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc if query_start_loc is not None else seq_lens,
        out, part_out, part_stats, scale * _LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_partitions, *_rope_args(rope, seq_lens, query),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=plan.block_n, PARTITION_SIZE=plan.partition_size, DYNAMIC=plan.dynamic,
        SINGLE_PARTITION=single,
        USE_WINDOW=sliding_window is not None, DOT_PRECISION=_dot_precision(query), UPCAST=_upcast(query),
        STEP_ROWS=query_start_loc is not None, ROPE=rope is not None,
        FENCE=rope is not None and query.is_cuda and not _INTERPRET, PDL=pdl, EARLY=early,
        num_warps=num_warps,
        num_stages=plan.num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            seq_lens, query_start_loc if query_start_loc is not None else seq_lens, out, part_out, part_stats,
            out.stride(0), out.stride(1), num_partitions,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), PARTITION_SIZE=plan.partition_size,
            BLOCK_N=plan.block_n, DYNAMIC=plan.dynamic, CHUNK=min(reduce_chunk, next_pow2(num_partitions)),
            STEP_ROWS=query_start_loc is not None, TRIGGER=pdl_supported(out), PDL=pdl, EARLY=early, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return out


def _decode_output(
    query: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    out: torch.Tensor | None,
    rope: DecodeRope | None,
) -> tuple[int, torch.Tensor]:
    """The number of sequences the call decodes and the tensor it writes, both checked: one query row per sequence
    (``out`` new if None), or with ``query_start_loc`` a mixed step's rows (no rope there)."""
    if query_start_loc is not None:
        if rope is not None:
            raise ValueError("rope: decode steps only (a mixed step's rows take kernels.rope_cache first)")
        num_seqs = _check_step_rows(query, seq_lens, query_start_loc, out)
        assert out is not None  # _check_step_rows refuses None
        return num_seqs, out
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"decode takes one query per sequence: {query.shape[0]} queries, {seq_lens.shape[0]} seqs")
    return query.shape[0], output_like(query, out)


def _rope_args(rope: DecodeRope | None, seq_lens: torch.Tensor, query: torch.Tensor) -> tuple[Any, ...]:
    """The kernel's rope arguments: positions, slots, cos/sin, raw key and value, and their strides (any
    tensor and zeros without rope: ROPE is then a compile-time False and none of them is read)."""
    if rope is None:
        return seq_lens, seq_lens, query, query, query, 0, 0, 0
    return (
        rope.positions, rope.slot_mapping, rope.cos_sin_cache, rope.key, rope.value, rope.cos_sin_cache.stride(0),
        rope.key.stride(0), rope.key.stride(1),
    )  # fmt: skip
