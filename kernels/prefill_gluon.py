"""Causal prefill attention for Hopper written in Gluon (Triton's explicit-layout dialect), for fresh prompts:
each sequence's keys and values are this step's (no cached prefix), read by TMA from the contiguous
``[num_tokens, num_kv_heads, head_dim]`` tensors. The engine sends a prefill step's trailing fresh prompts here
(``engine.attention``); the rest of the step goes to ``kernels.prefill_new_kv``.

Why Gluon: Triton 3.6 waits for each warpgroup MMA as soon as it is issued on sm_90 (the TTGIR of
``kernels.prefill_new_kv`` has ``warp_group_dot_wait {pendings = 0}`` after every dot), so the softmax of a tile
never overlaps the tensor cores. Here the waits are written out as FlashAttention-3's intra-warpgroup overlap:
tile i's softmax runs while tile i - 1's ``P V`` is in flight, and both MMAs retire inside the iteration (one
left in flight across the loop's back edge made ptxas serialize every wgmma: its C7514 note, which the CPU test
checks is absent). The causal diagonal's tile, the only masked one, is visited first, then the tiles below it.
By default the kernel is warp-specialized (``kernels.prefill_gluon_ws``) and its grid walks one KV head's tiles
before the next. Rows are packed as in ``kernels.prefill_new_kv`` (a tile's 128 rows are ``128 / GROUP`` tokens x
the ``GROUP`` query heads of one KV head), so each K/V tile serves the whole group. H200, 8B heads, bf16: 584-587
/ 637-647 TFLOP/s at 4k / 8k causal, 1.05-1.10x SDPA (cuDNN) and 1.28x prefill_new_kv (``loadtest.prefill_bench``).

No interpreter runs Gluon: ``tests/kernels/test_prefill_gluon.py`` compiles it for sm_90 on CPU, and its GPU
test checks it against :func:`kernels.prefill_new_kv.prefill_attention_new_kv_ref`.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import require_triton
from kernels.paged_attention import _LOG2E

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the CTA barrier: thread_barrier in Triton 3.6 (the H200's), barrier from 3.7 (this machine's CPU build)
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError:  # pragma: no cover - no Triton, or one without Gluon: the kernel is unavailable
    gluon = None

# Query rows of a program: 128 on two warpgroups (one CTA per SM at 128-key tiles), or 64 on one warpgroup, where
# 64-key tiles fit two CTAs per SM (112 KiB of shared memory each) whose softmax and MMAs the warp schedulers can
# interleave (the overlap FlashAttention-3 gets from its two ping-ponging warpgroups). A warpgroup is 64 rows.
ROWS = 128
BLOCK_N = 128  # keys of a tile
# the step's shape: not specialized on (one compile for every step, the engine's warm-up's; specialized, a
# first `mixed` run on the H200 compiled variants inside it: 10.1 s for mixed-128 against 5.0 s once cached)
SHAPE_ARGS = ["seq0", "tok0", "num_seqs"]
NUM_STAGES = 3  # K/V stages: tile j + 2 loads into tile j - 1's stage while tile j computes


def gluon_available(query: torch.Tensor) -> bool:
    """Whether this kernel can run the call: Gluon, a Hopper GPU (sm_90), 16-bit, a power-of-two head_dim of
    64 or 128 and a power-of-two group of at most 16 query heads per KV head."""
    if gluon is None or query.device.type != "cuda" or torch.cuda.get_device_capability(query.device)[0] != 9:
        return False
    return query.dtype in (torch.bfloat16, torch.float16) and query.shape[2] in (64, 128)


if gluon is not None:

    @gluon.jit
    def _locate(tile, query_start_loc_ptr, seq0, tok0, num_seqs, BLOCK_Q: gl.constexpr):
        """The sequence owning query tile ``tile`` of the sequences from ``seq0`` on (their first token ``tok0``):
        its first row, its length and the tile's first token. As ``kernels.prefill_attention._locate_tile``, tiles
        are numbered (q_start - tok0) // BLOCK_Q + seq - seq0 on."""
        lo = seq0
        hi = num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            first = (gl.load(query_start_loc_ptr + mid) - tok0) // BLOCK_Q + mid - seq0
            lo = gl.where(first <= tile, mid, lo)
            hi = gl.where(first <= tile, hi, mid)
        q_start = gl.load(query_start_loc_ptr + lo)
        q_len = gl.load(query_start_loc_ptr + lo + 1) - q_start
        return q_start, q_len, (tile - ((q_start - tok0) // BLOCK_Q + lo - seq0)) * BLOCK_Q

    @gluon.jit
    def program_tile(HEAD_MAJOR: gl.constexpr):
        """(query tile, kv head) of this program, the longest causal rows first. HEAD_MAJOR: grid (tile, kv
        head), so the programs resident at once share one head's K/V in L2; else grid (kv head, tile)."""
        if HEAD_MAJOR:
            return gl.num_programs(0) - 1 - gl.program_id(0), gl.program_id(1)
        else:
            return gl.num_programs(1) - 1 - gl.program_id(1), gl.program_id(0)

    @gluon.jit
    def _load_tile(k_desc, v_desc, k_smem, v_smem, ready, i, num_tiles, row0, col, NUM_STAGES: gl.constexpr):
        """TMA of the i-th K/V tile a program visits into stage ``i % NUM_STAGES``: the tiles are visited from the
        causal diagonal's (the last, ``num_tiles - 1``) down to the first (rows ``row0 + tile * BLOCK_N``)."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        s = i % NUM_STAGES
        row = row0 + (num_tiles - 1 - i) * BLOCK_N
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, col], ready.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [row, col], ready.index(s), v_smem.index(s))

    @gluon.jit
    def _qk(q_smem, k_smem, ready, i, s_shape, NUM_STAGES: gl.constexpr):
        """Issue the i-th visited tile's ``Q K^T`` (asynchronous) once its keys have landed (``s_shape``: any
        tensor of the scores' shape and layout, not read: ``use_acc=False``)."""
        s = i % NUM_STAGES
        mbarrier.wait(ready.index(s), (i // NUM_STAGES) & 1)
        return warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s_shape, use_acc=False, is_async=True)

    @gluon.jit
    def _softmax(s, m_i, l_i, scale_log2, p_layout: gl.constexpr, dtype: gl.constexpr):
        """One tile's online-softmax step on the raw scores: P (16-bit, as the P V MMA's register operand), the
        accumulator's rescale factor and the new row max and sum."""
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
        p = gl.exp2(s * scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i

    @gluon.jit
    def _rescale(acc, alpha):
        return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]

    @gluon.jit
    def _release(k_desc, v_desc, k_smem, v_smem, ready, empty, i, num_tiles, row0, col, NUM_STAGES: gl.constexpr,
                 PRODUCER: gl.constexpr):  # fmt: skip
        """The i-th visited tile's stage is free: tell the producer partition, or refill it with the tile
        ``NUM_STAGES`` visits on once every warp is past it."""
        if PRODUCER:
            mbarrier.arrive(empty.index(i % NUM_STAGES), count=1)
        elif i + NUM_STAGES < num_tiles:
            _cta_barrier()
            _load_tile(k_desc, v_desc, k_smem, v_smem, ready, i + NUM_STAGES, num_tiles, row0, col, NUM_STAGES)

    @gluon.jit
    def load_q(q_ptr, q_start, q_len, q_tile_start, kvh, stride_qt, stride_qh, GROUP: gl.constexpr,
               HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
        """The tile's queries in shared memory, row r the token q_tile_start + r // GROUP, head kvh * GROUP +
        r % GROUP (zeros past the sequence), fenced for the MMAs and past a CTA barrier."""
        q_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], q_ptr.dtype.element_ty)
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_load))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_load))
        tok = q_tile_start + r // GROUP
        q_rows = (q_start + tok).to(gl.int64) * stride_qt + (kvh * GROUP + r % GROUP) * stride_qh
        q = gl.load(q_ptr + q_rows[:, None] + d[None, :], mask=(tok < q_len)[:, None], other=0.0)
        return gl.allocate_shared_memory(q.dtype, [ROWS, HEAD_DIM], q_shared, q)

    @gluon.jit
    def attend(
        q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, out_ptr, scale_log2, q_start, q_len, q_tile_start,
        kvh, num_tiles, stride_ot, stride_oh, GROUP: gl.constexpr, NUM_STAGES: gl.constexpr, ROW0: gl.constexpr,
        PRODUCER: gl.constexpr,
    ):  # fmt: skip
        """The rows ``ROW0 ..`` of a query tile (``q_smem``: 64 or 128 of them, one or two warpgroups) over its
        ``num_tiles`` K/V tiles, then their output. ``PRODUCER``: another partition loads the tiles, told by an
        arrival on ``empty`` that a stage is free; else these warps refill it themselves."""
        ROWS: gl.constexpr = q_smem.shape[0]
        HEAD_DIM: gl.constexpr = q_smem.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROWS // 16, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROWS // 16, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        col = kvh * HEAD_DIM
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        # the causal diagonal's tile first (BLOCK_Q <= BLOCK_N: one per query tile), the only one masked
        s = _qk(q_smem, k_smem, ready, 0, gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), NUM_STAGES)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        r_s = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        last = num_tiles - 1
        s = gl.where(last * BLOCK_N + cols[None, :] <= (q_tile_start + r_s // GROUP)[:, None], s, float("-inf"))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, scale_log2, p_layout, v_desc.dtype)
        # FlashAttention-3's order: both MMAs retire inside the iteration (an MMA in flight across the loop's
        # back edge makes ptxas serialize every wgmma, C7514), tile i's softmax overlapping tile i - 1's P V
        for i in range(1, num_tiles):
            s = _qk(q_smem, k_smem, ready, i, s, NUM_STAGES)
            acc = warpgroup_mma(p, v_smem.index((i - 1) % NUM_STAGES), _rescale(acc, alpha), is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # tile i's Q K^T; tile i - 1's P V in flight
            p_next, alpha, m_i, l_i = _softmax(s, m_i, l_i, scale_log2, p_layout, v_desc.dtype)
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))  # P is read until its MMA retires
            p = p_next
            _release(k_desc, v_desc, k_smem, v_smem, ready, empty, i - 1, num_tiles, q_start, col, NUM_STAGES,
                     PRODUCER)  # fmt: skip
        acc = warpgroup_mma(p, v_smem.index(last % NUM_STAGES), _rescale(acc, alpha), is_async=True)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
        r_o = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        tok_o = q_tile_start + r_o // GROUP
        o_rows = (q_start + tok_o).to(gl.int64) * stride_ot + (kvh * GROUP + r_o % GROUP) * stride_oh
        gl.store(out_ptr + o_rows[:, None] + d_o[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=(tok_o < q_len)[:, None])  # fmt: skip

    @gluon.jit(do_not_specialize=SHAPE_ARGS)
    def _prefill_gluon_kernel(
        q_ptr, k_desc, v_desc, out_ptr, query_start_loc_ptr, seq0, tok0, num_seqs, scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, ROWS: gl.constexpr,
        HEAD_MAJOR: gl.constexpr,
    ):  # fmt: skip
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        BLOCK_Q: gl.constexpr = ROWS // GROUP
        tile, kvh = program_tile(HEAD_MAJOR)
        q_start, q_len, q_tile_start = _locate(tile, query_start_loc_ptr, seq0, tok0, num_seqs, BLOCK_Q)
        if q_tile_start < q_len:
            q_smem = load_q(q_ptr, q_start, q_len, q_tile_start, kvh, stride_qt, stride_qh, GROUP, HEAD_DIM, ROWS,
                            ROWS // 16)  # fmt: skip
            k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NUM_STAGES):
                mbarrier.init(ready.index(i), count=1)
            fence_async_shared()
            _cta_barrier()  # Q in shared memory from every warp before either warpgroup's first MMA

            num_tiles = gl.cdiv(gl.minimum(q_tile_start + BLOCK_Q, q_len), BLOCK_N)  # causal: to the last query
            for i in gl.static_range(NUM_STAGES):
                if i < num_tiles:
                    _load_tile(k_desc, v_desc, k_smem, v_smem, ready, i, num_tiles, q_start, kvh * HEAD_DIM,
                               NUM_STAGES)  # fmt: skip
            attend(q_smem, k_smem, v_smem, ready, ready, k_desc, v_desc, out_ptr, scale_log2, q_start, q_len,
                   q_tile_start, kvh, num_tiles, stride_ot, stride_oh, GROUP, NUM_STAGES, 0, False)  # fmt: skip
            for i in gl.static_range(NUM_STAGES):
                mbarrier.invalidate(ready.index(i))


def prefill_attention_gluon(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys (rotated)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # written in place (the rows of sequences before ``first`` left as they are)
    first: tuple[int, int] = (0, 0),  # (sequence, its first token): attend from this sequence on
    *,
    num_stages: int = NUM_STAGES,
    block_n: int = BLOCK_N,
    rows: int = ROWS,  # 128 or 64 (one partition only) query rows a program
    warp_specialize: bool = True,  # kernels.prefill_gluon_ws: a producer warp, two one-warpgroup consumers
    head_major: bool = True,  # the grid walks one KV head's tiles before the next (L2 reuse of its K/V)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over themselves, from sequence ``first[0]`` (whose first
    row is ``first[1]``) on: fresh prompts, no cached prefix. Equals
    :func:`kernels.prefill_new_kv.prefill_attention_new_kv_ref` with empty prefixes on those rows."""
    require_triton("prefill_attention_gluon")
    if not gluon_available(query):
        raise ValueError("prefill_attention_gluon: needs Gluon, an sm_90 GPU, bf16/fp16 and head_dim 64 or 128")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    _check_args(query, key, value, group, num_stages, block_n, rows, warp_specialize)
    out = torch.empty_like(query) if out is None else out
    num_seqs = query_start_loc.shape[0] - 1
    seq0, tok0 = first
    if num_tokens == tok0 or num_seqs == seq0:
        return out
    layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], _GL_DTYPES[query.dtype])
    flat = [num_tokens, num_kv_heads * head_dim]
    descs: list[Any] = [
        TensorDescriptor(t, flat, [t.stride(0), 1], [block_n, head_dim], layout) for t in (key, value)
    ]  # fmt: skip
    num_tiles = (num_tokens - tok0) // (rows // group) + num_seqs - seq0  # a bound on the query tiles (no sync)
    grid = (num_tiles, num_kv_heads) if head_major else (num_kv_heads, num_tiles)
    args = (query, descs[0], descs[1], out, query_start_loc, seq0, tok0, num_seqs, scale * _LOG2E,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1))  # fmt: skip
    consts = {"GROUP": group, "HEAD_DIM": head_dim, "NUM_STAGES": num_stages, "HEAD_MAJOR": head_major}
    if warp_specialize:
        from kernels.prefill_gluon_ws import LAUNCH_MAXNREG, _prefill_gluon_ws_kernel

        _prefill_gluon_ws_kernel[grid](*args, **consts, num_warps=4, maxnreg=LAUNCH_MAXNREG)
    else:
        _prefill_gluon_kernel[grid](*args, **consts, ROWS=rows, num_warps=rows // 16)
    return out


def _check_args(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: int, num_stages: int, block_n: int,
    rows: int, warp_specialize: bool,
) -> None:  # fmt: skip
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if group * num_kv_heads != num_heads or group & (group - 1) or group > 16:
        raise ValueError(f"query heads per KV head must be a power of two <= 16, got {num_heads} / {num_kv_heads}")
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")
    if rows not in (64, 128) or block_n < rows // group or (warp_specialize and rows != 128):
        raise ValueError(f"rows must be 64 or 128 (128 warp-specialized) and block_n hold a query tile's tokens, got "
                         f"{rows} and {block_n}")  # fmt: skip
    if query.stride(2) != 1:
        raise ValueError(f"query must be contiguous in head_dim, got strides {query.stride()}")
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != (num_tokens, num_kv_heads, head_dim) or t.dtype != query.dtype or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim] {query.dtype} with adjacent heads")


def engine_can_use(query: torch.Tensor, key: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether the engine's prefill steps can send their fresh prompts here: an sm_90 GPU with Gluon, 16-bit,
    head_dim 64 or 128, a power-of-two group of at most 16 query heads per KV head, no sliding window."""
    group = query.shape[1] // key.shape[1]
    return sliding_window is None and gluon_available(query) and group <= 16 and group & (group - 1) == 0


_GL_DTYPES: dict[torch.dtype, Any] = {} if gluon is None else {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
