"""The merge half of flash-decoding (``kernels.paged_attention``): each partition's (max, sum, output) rows are
combined into the head's output by a second launch (``_decode_reduce_kernel``); and the two facts both halves must
agree on: a partition's length and which query row a sequence decodes."""

from __future__ import annotations

from kernels._triton import tl, triton
from kernels.pdl import launch_dependents, wait_prior_grids


@triton.jit
def _merge_partitions(
    seq_len, part_len, base, out_row_ptr, part_out_ptr, part_stats_ptr, num_partitions,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Merge one head's partition results (scratch rows ``base + p``) into its output row: an online softmax
    over chunks of partitions, so a chunk's stats and outputs come in one L2 round trip (.cg: from L2,
    where the other programs' stores landed)."""
    num_parts = tl.minimum(tl.cdiv(seq_len, part_len), num_partitions)  # the rest were never written
    d = tl.arange(0, HEAD_DIM_PAD)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for c in range(0, num_parts, CHUNK):
        pc = c + tl.arange(0, CHUNK)
        pc_mask = pc < num_parts
        m_c = tl.load(part_stats_ptr + (base + pc) * 2, mask=pc_mask, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(part_stats_ptr + (base + pc) * 2 + 1, mask=pc_mask, other=0.0, cache_modifier=".cg")
        o_c = tl.load(part_out_ptr + (base + pc)[:, None] * HEAD_DIM + d[None, :],
                      mask=pc_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m_c, axis=0))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a window may hide whole partitions
        alpha = tl.exp2(m_run - m_ref)
        w = l_c * tl.exp2(m_c - m_ref)  # [CHUNK]
        acc = acc * alpha + tl.sum(w[:, None] * o_c, axis=0)
        l_run = l_run * alpha + tl.sum(w, axis=0)
        m_run = m_new
    o = acc / tl.where(l_run > 0.0, l_run, 1.0)
    tl.store(out_row_ptr + d, o.to(out_row_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _partition_len(seq_len, num_partitions, PARTITION_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DYNAMIC: tl.constexpr):
    """Tokens per partition of a sequence of ``seq_len``: PARTITION_SIZE, or with DYNAMIC the sequence's own length
    cut into ``num_partitions`` whole tiles (a graph captured for a long context still spreads a short sequence
    over the grid; partitions past the sequence's end get no tokens). The partition kernel and the merge agree."""
    if DYNAMIC:
        return tl.cdiv(tl.cdiv(seq_len, num_partitions), BLOCK_N) * BLOCK_N
    else:
        return seq_len * 0 + PARTITION_SIZE


@triton.jit
def _query_row(seq, query_start_loc_ptr, STEP_ROWS: tl.constexpr):
    """Sequence ``seq``'s query row and whether it decodes in this call: row ``seq`` of a decode step, or with
    STEP_ROWS row ``query_start_loc[seq]`` of a mixed step, only where that sequence has one new token (the
    others are the prefill kernel's)."""
    if STEP_ROWS:
        start = tl.load(query_start_loc_ptr + seq)
        return start, (tl.load(query_start_loc_ptr + seq + 1) - start) == 1
    else:
        return seq, seq >= 0


@triton.jit
def _decode_reduce_kernel(
    seq_lens_ptr, query_start_loc_ptr, out_ptr, part_out_ptr, part_stats_ptr,
    stride_os, stride_oh, num_partitions,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTITION_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DYNAMIC: tl.constexpr, CHUNK: tl.constexpr, STEP_ROWS: tl.constexpr, TRIGGER: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):  # fmt: skip
    """EARLY: the step's inputs are read before the PDL wait (the partition kernel waits before it triggers)."""
    if PDL and not EARLY:  # launched with launch_pdl (kernels.pdl): the partitions kernel's output is read below
        wait_prior_grids()
    if TRIGGER and not EARLY:  # a PDL-launched next kernel (o_proj's int4 GEMV) may start (kernels.pdl)
        launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row, is_row = _query_row(seq, query_start_loc_ptr, STEP_ROWS)
    if PDL and EARLY:
        wait_prior_grids()
    if TRIGGER and EARLY:
        launch_dependents()
    if is_row:
        _merge_partitions(
            seq_len, _partition_len(seq_len, num_partitions, PARTITION_SIZE, BLOCK_N, DYNAMIC),
            (seq * tl.num_programs(1) + head) * num_partitions, out_ptr + q_row * stride_os + head * stride_oh,
            part_out_ptr, part_stats_ptr, num_partitions, HEAD_DIM, HEAD_DIM_PAD, CHUNK,
        )  # fmt: skip
