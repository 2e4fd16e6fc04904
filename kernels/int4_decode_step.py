"""The 4-bit Llama decode step at batch 1 in one persistent launch: every layer's projections, rotary embedding,
KV-cache write and attention (#13's batch-1 goal; ``kernels.int4_decode_tasks`` builds its tables and launches it).

Why (docs/benchmarks.md, Sessions 21-24): a batch-1 int4 step is ~275 kernels. With every GEMV at the speed of a
copy of its bytes it would still take ~1.8 ms against the 1.1 ms floor; the ramps, tails and launches of short
kernels are the rest. Here a grid of programs walks one task table (``kernels.int4_decode_plan``). A task waits on
a counter of the tasks before it (the whole phase before, or only those writing its inputs), does its part and
counts itself in. Each layer has five phases:

- QKV: ``TN`` columns of qkv_proj over the residual stream ``h`` normalized (input_layernorm; late, as
  :func:`_gemv_task` says);
- ATTN: one KV head and one of its ``P_MAX`` partitions of the positions (as long as the context asks, in whole
  ``BT``-key tiles, so every partition has work): its query heads and the new key rotated (neox), the
  scores over the cached keys and the new one, an online softmax. The partition holding the new token stores its
  key and value in the cache; the head's last partition to arrive merges all of them into the attention output;
- O: ``TN`` columns of o_proj over that, plus ``h``, into the second stream buffer ``h2``;
- GATE_UP: ``TN / 2`` columns of gate and as many of up over ``h2`` normalized (post_attention_layernorm), then
  ``silu(gate) * up``;
- DOWN: ``TN`` columns of down_proj over that, plus ``h2``, into ``h``.

A projection may split K over several tasks (``splits``: o_proj and down_proj have few columns for many SMs); their
sums meet in fp32 atomics and the column tile's last task writes it.

The table lists the tasks phase by phase, and programs claim them in that order from a shared counter. A task
waits only for tasks before it in the table, so the lowest unfinished task is always a running program's current
one, and no program waits forever, whatever the grid and however many programs are resident. Outputs reach their
readers through the L2: the producer's barrier and release add, the consumer's acquire, and ``.cg`` loads. The
last program to finish zeroes the counters for the next launch (CUDA graph replays). Under the interpreter (one program) the tasks run in table order.

The arithmetic is the engine's: the GEMV's factored int4 tile (``kernels.int4_gemv``),
``kernels.activation.silu_mul``, the residual adds in x's dtype. The norms round elsewhere: the stream times the
norm's weight rounds to x's dtype, and ``1 / rms`` scales the fp32 sums (the engine rounds the stream times
``1 / rms``, then that times the weight). On the H200
(docs/benchmarks.md, Sessions 27-32) it is correct and ~3.7x its floor (3.19 ms for 32 layers at 128 tokens,
Session 32), slower than the layer-by-layer step (~2.3 ms with the LM head), so the engine leaves it off: its GEMV
tasks stream ~7 GB/s a program and its programs wait ~18 % of the time. Session 28 read the tiles as bound by
instruction issue (~5.5 SASS instructions a weight), but the GEMVs on the tensor cores (~2.7 instructions a weight)
made the step 1.9x slower on the H200 (8.01 against 4.16 ms, Session 31) and were removed. An L2 prefetch
of the next task's words when it is claimed lost (Session 27) and was removed. Attention's products are ``tl.dot``s
since Session 30 (``kernels.int4_decode_attn``: ~9x fewer instructions a key tile; at 4,096 tokens the step went
from 6.38 to 4.74 ms).
"""

from __future__ import annotations

from kernels._triton import HAS_TRITON, tl, triton
from kernels.activation import silu_mul
from kernels.int4_decode_attn import _attn_task
from kernels.int4_gemv import _split8, nibble

QKV, ATTN, O_PROJ, GATE_UP, DOWN = 0, 1, 2, 3, 4  # task kinds, in a layer's phase order
TASK_FIELDS = 6  # kind, layer, index, wait slot, wait target, done slot
# a layer's row of the pointer table: qweight, scales, zeros of qkv, o, gate_up, down and the KV cache (offsets in
# elements from the kernel's four bases); the two norm weights (addresses)
IN_NORM, POST_NORM, KV_CACHE = 12, 13, 14
PTR_FIELDS = 15
# TRACE's row a task: globaltimer ns at the top of its iteration, after the claim, after its wait,
# after its release; then its program id << 16 | the SM it ran on
TRACE_FIELDS = 5


def _const(value: int) -> int:
    """``value`` as the kernels below read module globals: a Triton constexpr (a plain int without Triton)."""
    return tl.constexpr(value) if HAS_TRITON else value  # type: ignore[no-any-return]


_QKV, _ATTN, _O, _GATE_UP = _const(QKV), _const(ATTN), _const(O_PROJ), _const(GATE_UP)
_TASK_FIELDS, _PTR_FIELDS = _const(TASK_FIELDS), _const(PTR_FIELDS)
_IN_NORM, _POST_NORM, _KV_CACHE = _const(IN_NORM), _const(POST_NORM), _const(KV_CACHE)
_TRACE_FIELDS = _const(TRACE_FIELDS)


@triton.jit
def _stamp(TRACE: tl.constexpr):
    """The GPU's nanosecond clock (inline PTX: compiled only, never under the interpreter) if TRACE, else 0."""
    if TRACE:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.zeros((), tl.int64)


@triton.jit
def _trace(row_ptr, top, claimed, ready, TRACE: tl.constexpr):
    if TRACE:
        tl.store(row_ptr, top)
        tl.store(row_ptr + 1, claimed)
        tl.store(row_ptr + 2, ready)
        tl.store(row_ptr + 3, _stamp(TRACE))
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        tl.store(row_ptr + 4, (tl.program_id(0).to(tl.int64) << 16) | sm.to(tl.int64))


@triton.jit
def _wait(cnt_ptr, target):
    """Spins until the counter reaches ``target``, then acquires it: the counted tasks' stores are visible after.
    The spin reads are volatile loads, not atomics, so the pollers do not queue up with the producers' adds (a
    ``nanosleep`` between them changed nothing on the H200, docs/benchmarks.md, Session 28)."""
    c = tl.load(cnt_ptr, volatile=True)
    while c < target:
        c = tl.load(cnt_ptr, volatile=True)
    tl.atomic_add(cnt_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _proj(kind):
    """A GEMV kind's projection: its index (0..3: qkv, o, gate_up, down) in the pointer table and in ``splits``."""
    return tl.where(kind > _ATTN, kind - 1, kind)


@triton.jit
def _wptr(ptrs_ptr, layer, field, base):
    """A layer's weight array or KV cache: ``base`` (a kernel argument, so 16-byte aligned as Triton specializes it) plus the
    table's offset in elements, a multiple of 16 bytes (``Int4DecodeStep`` checks it). Triton then knows the
    rows' alignment and copies them 16 bytes a thread, which it cannot for a pointer read from memory."""
    off = tl.load(ptrs_ptr + layer * _PTR_FIELDS + field)
    return base + tl.multiple_of(off, 128 // base.dtype.element_ty.primitive_bitwidth)


@triton.jit
def _inv_rms(h_ptr, H, eps, HP: tl.constexpr):
    """``1 / rms`` of the stream ``h [H]``, as ``kernels.norm``: ``1 / sqrt(sum h^2 / H + eps)``."""
    offs = tl.arange(0, HP)
    h = tl.load(h_ptr + offs, mask=offs < H, other=0.0, cache_modifier=".cg").to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)


@triton.jit
def _narrow_loads(x_ptr, s_ptr, z_ptr, k0, k_hi, offs_n, mask_n, N, GROUP: tl.constexpr, BK: tl.constexpr):
    """A bk-tile's operands too narrow a thread for cp.async, so never pipelined by Triton: x ``[BK / 8, 8]``, the
    scales and zeros of its group ``[TN]``; zeros past ``k_hi``."""
    xk = k0 + 8 * tl.arange(0, BK // 8)[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
    x = tl.load(x_ptr + xk, mask=xk < k_hi, other=0.0, cache_modifier=".cg")
    sz = (k0 // GROUP) * N + offs_n
    live = (k0 < k_hi) & mask_n
    return x, tl.load(s_ptr + sz, mask=live, other=0.0), tl.load(z_ptr + sz, mask=live, other=0)


@triton.jit
def _tile_sum(words, x, s, z, one_bits):
    """``kernels.int4_gemv.factored_tile``'s terms with its scales and zeros given: ``s (sum_j c_j x_j - z sum_j
    x_j)`` per word row ``[R, TN]`` fp32 of words ``[R, TN]``, x fp32 ``[R, 8]``, scales and zeros ``[TN]``; summed
    over the rows once a task (:func:`_gemv`), not per tile: the rows span warps, and each sum across them costs
    barriers."""
    R: tl.constexpr = words.shape[0]
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(x, (1, R, 8)), 1, R)
    x0, x1, x2, x3 = tl.reshape(x0, (R,)), tl.reshape(x1, (R,)), tl.reshape(x2, (R,)), tl.reshape(x3, (R,))
    x4, x5, x6, x7 = tl.reshape(x4, (R,)), tl.reshape(x5, (R,)), tl.reshape(x6, (R,)), tl.reshape(x7, (R,))
    t = nibble(words, 0, one_bits) * x0[:, None]  # [R, TN]: sum_j (1 + c_j / 16) x_j
    t += nibble(words, 1, one_bits) * x1[:, None]
    t += nibble(words, 2, one_bits) * x2[:, None]
    t += nibble(words, 3, one_bits) * x3[:, None]
    t += nibble(words, 4, one_bits) * x4[:, None]
    t += nibble(words, 5, one_bits) * x5[:, None]
    t += nibble(words, 6, one_bits) * x6[:, None]
    t += nibble(words, 7, one_bits) * x7[:, None]
    xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # [R]
    s, z = s.to(tl.float32), z.to(tl.float32)
    return (16.0 * s)[None, :] * t - (s * (16.0 + z))[None, :] * xs[:, None]


@triton.jit
def _gemv(x_ptr, qw_ptr, s_ptr, z_ptr, offs_n, N, k_lo, k_hi, one_bits,
          GROUP: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """``x[k_lo:k_hi] @ W[k_lo:k_hi]`` at columns ``offs_n [TN]``: ``[TN]`` fp32; W int4 ``[K // 8, N]`` with
    scales and zeros ``[K // GROUP, N]``, all contiguous.

    Only the words are pipelined (cp.async): each tile loads the next tile's narrow operands into registers and
    computes on those loaded a tile before (on the H200 ~9 % faster than loading its own, docs/benchmarks.md,
    Session 27; two or four tiles a step were no faster)."""
    offs_r = tl.arange(0, BK // 8)
    mask_n = offs_n < N
    acc = tl.zeros((BK // 8, offs_n.shape[0]), dtype=tl.float32)
    x_n, s_n, z_n = _narrow_loads(x_ptr, s_ptr, z_ptr, k_lo, k_hi, offs_n, mask_n, N, GROUP, BK)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=NUM_STAGES):
        x, s, z = x_n, s_n, z_n
        x_n, s_n, z_n = _narrow_loads(x_ptr, s_ptr, z_ptr, k0 + BK, k_hi, offs_n, mask_n, N, GROUP, BK)
        rows = k0 // 8 + offs_r
        words = tl.load(qw_ptr + rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        acc += _tile_sum(words, x.to(tl.float32), s, z, one_bits)
    return tl.sum(acc, axis=0)


@triton.jit
def _columns(kind, tile, j, H, INTER, NQKV, HQD, TN: tl.constexpr):
    """A GEMV task's K, its weight's N and the columns ``j`` of column tile ``tile`` (GATE_UP: the gate's
    ``TN / 2`` columns there, then the same of up, INTER columns on)."""
    HALF: tl.constexpr = TN // 2
    if kind == _QKV:
        K, N, offs_n = H, NQKV, tile * TN + j
    elif kind == _O:
        K, N, offs_n = HQD, H, tile * TN + j
    elif kind == _GATE_UP:
        K, N, offs_n = H, 2 * INTER, tile * HALF + j + (j >= HALF).to(tl.int32) * (INTER - HALF)
    else:
        K, N, offs_n = INTER, H, tile * TN + j
    return K, N, offs_n


@triton.jit
def _gemv_task(kind, layer, index, num_layers, ptrs_ptr, qw_base, s_base, z_base, h_ptr, h2_ptr, g_ptr, qkv_ptr, attn_ptr,
               act_ptr, gws_ptr, proj_ptr, tile_cnt, eps, one_bits, H, INTER, NQKV, HQD, GROUP: tl.constexpr,
               HP: tl.constexpr, BK: tl.constexpr, TN: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """One GEMV task of ``kind`` (QKV, O_PROJ, GATE_UP or DOWN): column tile ``index // split``, the ``index %
    split``-th of its K ranges. Split K ranges add their sums into the projection's own part of ``gws`` (fp32
    atomics); the tile's last one to arrive (its counter in the projection's run of ``tile_cnt``) takes the total,
    leaves both at zero, and writes the output. ``proj``: per projection its split and the offsets of its runs.

    qkv and gate_up normalize late: their K loop reads ``g`` (the stream times the norm's weight, written with the
    stream, :func:`_gemv_out`) and their sums are multiplied by the stream's ``1 / rms`` at the end, so no GEMV
    normalizes in its loop (a norm as x is loaded cost ~6 instructions an activation a thread, Session 16)."""
    dtype = h_ptr.dtype.element_ty
    gi = _proj(kind)
    split = tl.load(proj_ptr + 3 * gi)
    tile_cnt += tl.load(proj_ptr + 3 * gi + 1)
    gws_ptr += tl.load(proj_ptr + 3 * gi + 2)
    tile = index // split
    K, N, offs_n = _columns(kind, tile, tl.arange(0, TN), H, INTER, NQKV, HQD, TN)
    inv = tl.full((), 1.0, tl.float32)
    x_ptr = act_ptr  # DOWN
    if kind == _QKV:
        x_ptr = g_ptr
        inv = _inv_rms(h_ptr, H, eps, HP)
    elif kind == _O:
        x_ptr = attn_ptr
    elif kind == _GATE_UP:
        x_ptr = g_ptr + H
        inv = _inv_rms(h2_ptr, H, eps, HP)
    k_per = tl.cdiv(tl.cdiv(K, BK), split) * BK
    k_lo = (index % split) * k_per
    qw_ptr, k_hi = _wptr(ptrs_ptr, layer, 3 * gi, qw_base), tl.minimum(k_lo + k_per, K)
    s_ptr, z_ptr = _wptr(ptrs_ptr, layer, 3 * gi + 1, s_base), _wptr(ptrs_ptr, layer, 3 * gi + 2, z_base)
    acc = _gemv(x_ptr, qw_ptr, s_ptr, z_ptr, offs_n, N, k_lo, k_hi, one_bits, GROUP, BK, NUM_STAGES)
    acc = tl.reshape(acc, (TN,)) * inv
    mask = offs_n < N
    last = split == 1
    if split > 1:  # kernels.int4_split.finish_tile's ordering
        tl.atomic_add(gws_ptr + offs_n, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()
        if tl.atomic_add(tile_cnt + tile, 1, sem="acq_rel") == split - 1:
            acc = tl.load(gws_ptr + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's read before any zeroing
            tl.store(gws_ptr + offs_n, tl.zeros_like(acc), mask=mask)
            tl.store(tile_cnt + tile, 0)
            last = True
    if last:
        _gemv_out(kind, layer, num_layers, acc.to(dtype), offs_n, tile, ptrs_ptr, h_ptr, h2_ptr, g_ptr, qkv_ptr,
                  act_ptr, N, INTER, TN)  # fmt: skip


@triton.jit
def _gemv_out(kind, layer, num_layers, y, offs_n, tile, ptrs_ptr, h_ptr, h2_ptr, g_ptr, qkv_ptr, act_ptr, N, INTER,
              TN: tl.constexpr):  # fmt: skip
    """A finished column tile ``y [TN]`` (x's dtype) to its place: qkv, silu(gate) * up, or the residual stream
    plus ``y``: o_proj's from ``h`` into ``h2``, down_proj's from ``h2`` into ``h``. Two buffers, so a layer's
    o_proj and down_proj never write the stream that its qkv or gate_up tasks may still be reading. With the
    stream, its columns times the next norm's weight into ``g`` (o_proj: ``g[H:]``, the layer's
    post_attention_layernorm; down_proj: ``g[:H]``, the next layer's input_layernorm), rounded as the stream is."""
    HALF: tl.constexpr = TN // 2
    if kind == _QKV:
        tl.store(qkv_ptr + offs_n, y, mask=offs_n < N)
    elif kind == _GATE_UP:
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, HALF)), (1, 0)))
        cols = tile * HALF + tl.arange(0, HALF)
        tl.store(act_ptr + cols, silu_mul(gate, up), mask=cols < INTER)
    else:  # O_PROJ, DOWN: the residual add
        if kind == _O:
            src, dst, gdst = h_ptr, h2_ptr, g_ptr + N
            nw_at = layer * _PTR_FIELDS + _POST_NORM
        else:
            src, dst, gdst = h2_ptr, h_ptr, g_ptr
            nw_at = (layer + 1) * _PTR_FIELDS + _IN_NORM
        mask = offs_n < N
        h = tl.load(src + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
        h = (h.to(tl.float32) + y.to(tl.float32)).to(y.dtype)
        tl.store(dst + offs_n, h, mask=mask)
        if nw_at < num_layers * _PTR_FIELDS:  # not after the last layer: no next norm in the step
            nw = tl.load(tl.load(ptrs_ptr + nw_at).to(tl.pointer_type(y.dtype)) + offs_n, mask=mask, other=0.0)
            tl.store(gdst + offs_n, (h.to(tl.float32) * nw.to(tl.float32)).to(y.dtype), mask=mask)


@triton.jit
def _int4_decode_step_kernel(
    tasks_ptr, num_tasks, cnt_ptr, num_counters, ptrs_ptr, qw_base, s_base, z_base, kv_base,
    h_ptr, h2_ptr, g_ptr, qkv_ptr, attn_ptr, act_ptr, ws_o, ws_m, ws_l, gws_ptr, proj_ptr, bt_ptr, seq_len_ptr,
    cs_ptr, trace_ptr, v_off, scale, eps, one_bits, H, INTER, HQ, HKV, P_MAX, num_layers, head_slots, tile_slots,
    GROUP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, QG: tl.constexpr,
    BS: tl.constexpr, BT: tl.constexpr, PP: tl.constexpr, BK: tl.constexpr, TN: tl.constexpr,
    NUM_STAGES: tl.constexpr, TRACE: tl.constexpr, COMPILED: tl.constexpr,
):  # fmt: skip
    """The module docstring's task loop. TRACE: each task's timestamps into ``trace``
    (``TRACE_FIELDS`` a task, in table order). COMPILED: False under the interpreter
    (attention's ``tl.dot``s, ``kernels.int4_decode_attn``). ``cnt`` holds the wait counters, then the heads'
    arrival counters (``head_slots`` on, one per layer and KV head), the GEMV column tiles' (``tile_slots`` on, a
    run per projection), the claim counter and the exit counter (``kernels.int4_decode_plan.TaskPlan``). A program
    claims its tasks in table order, each one claim ahead (an atomic off the task's path): phases of any size spread
    over the programs without a static round-robin's last partial round, and, as every task's wait counts only
    tasks before it in the table, the lowest unfinished task is always some program's current one, so it can run."""
    grid = tl.num_programs(0)
    pos = tl.load(seq_len_ptr) - 1
    part_len = tl.cdiv(tl.cdiv(pos + 1, P_MAX), BT) * BT  # the context over P_MAX partitions, in whole tiles
    num_parts = tl.cdiv(pos + 1, part_len)
    claim = cnt_ptr + num_counters - 2
    t = tl.atomic_add(claim, 1, sem="relaxed")
    while t < num_tasks:
        top = _stamp(TRACE)
        t_next = tl.atomic_add(claim, 1, sem="relaxed")
        claimed = _stamp(TRACE)
        row = tasks_ptr + t * _TASK_FIELDS
        kind, layer, index = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        _wait(cnt_ptr + tl.load(row + 3), tl.load(row + 4))
        ready = _stamp(TRACE)
        if kind == _ATTN:
            g, part = index // P_MAX, index % P_MAX
            _attn_task(
                qkv_ptr, attn_ptr, _wptr(ptrs_ptr, layer, _KV_CACHE, kv_base), v_off, bt_ptr, cs_ptr,
                ws_o, ws_m, ws_l, cnt_ptr + head_slots + layer * HKV + g, g, part, pos, part_len, num_parts, scale,
                HQ, HKV, P_MAX, D, QG, BS, BT, PP, NUM_STAGES, COMPILED,
            )  # fmt: skip
        else:
            _gemv_task(
                kind, layer, index, num_layers, ptrs_ptr, qw_base, s_base, z_base, h_ptr, h2_ptr, g_ptr, qkv_ptr,
                attn_ptr, act_ptr, gws_ptr, proj_ptr, cnt_ptr + tile_slots, eps, one_bits, H, INTER, (HQ + 2 * HKV) * D,
                HQ * D, GROUP, HP, BK, TN, NUM_STAGES,
            )  # fmt: skip
        tl.debug_barrier()  # every thread's stores before thread 0's release
        tl.atomic_add(cnt_ptr + tl.load(row + 5), 1, sem="release")
        _trace(trace_ptr + t * _TRACE_FIELDS, top, claimed, ready, TRACE)
        t = t_next
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + num_counters - 1, 1, sem="acq_rel") == grid - 1:  # the last program out
        for c0 in range(0, num_counters, 1024):
            offs = c0 + tl.arange(0, 1024)
            tl.store(cnt_ptr + offs, tl.zeros((1024,), tl.int32), mask=offs < num_counters)
