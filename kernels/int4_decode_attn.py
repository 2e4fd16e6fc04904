"""The attention tasks of the one-launch int4 decode step (``kernels.int4_decode_step``): one KV head's partition
of the positions, its query heads and new key rotated, the new key and value into the cache, an online softmax, and
the merge of the head's partitions by the last one to arrive. Its own module so the step's stays under ~400 lines.

The scores and the weighted values are ``tl.dot``s (the tensor cores), the head's query rows padded to 16 (the
MMA's M), as the layer-by-layer decode kernel computes them (``kernels.paged_attention``). The first version
multiplied on the CUDA cores, broadcasting ``[QG, BT, D]`` and reducing across threads: 2,058 SASS instructions a
16-key tile on sm_90 (348 shuffles, 14 barriers) for 128 multiply-adds a thread, ~3.7 us a tile on the H200
(Session 28: 60 us a layer more at 4,096 tokens than at 128)."""

from __future__ import annotations

from kernels._triton import tl, triton


@triton.jit
def _rotated(src_ptr, cos, sin, offs_d, HALF: tl.constexpr):
    """Rows ``src [.., D]`` (offsets ``offs_d`` broadcast) rotated by neox halves in fp32."""
    x = tl.load(src_ptr + offs_d, cache_modifier=".cg").to(tl.float32)
    partner = tl.load(src_ptr + (offs_d + HALF) % (2 * HALF), cache_modifier=".cg").to(tl.float32)
    sign = tl.where(offs_d % (2 * HALF) < HALF, -1.0, 1.0)
    return x * cos + sign * partner * sin


@triton.jit
def _dot(a, b, COMPILED: tl.constexpr):
    """``a @ b`` in fp32: 16-bit operands on the tensor cores; fp32 ones, and every one under the interpreter, as
    exact fp32 products (Triton 3.7's interpreter multiplies bf16 dot operands as their raw 16-bit integers)."""
    if COMPILED and a.dtype != tl.float32:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _attend(q, kv_ptr, v_off, bt_ptr, g, start, end, scale, HKV,
            D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, NUM_STAGES: tl.constexpr,
            COMPILED: tl.constexpr):  # fmt: skip
    """Positions ``[start, end)`` of KV head ``g`` (the new token's key and value already in the cache) for its
    query rows ``q [QGP, D]`` (the cache's dtype, rows past the head's zero): the online softmax's ``(acc [QGP, D],
    m [QGP], lsum [QGP])``."""
    QGP: tl.constexpr = q.shape[0]
    offs_d = tl.arange(0, D)
    m = tl.full((QGP,), float("-inf"), tl.float32)
    lsum = tl.zeros((QGP,), tl.float32)
    acc = tl.zeros((QGP, D), tl.float32)
    for t0 in tl.range(start, end, BT, num_stages=NUM_STAGES):
        t = t0 + tl.arange(0, BT)
        valid = t < end
        blk = tl.load(bt_ptr + t // BS, mask=valid, other=0)
        rows = (blk.to(tl.int64) * BS + t % BS) * (HKV * D) + g * D  # [BT] element offsets (int64: large caches)
        k = tl.load(kv_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(kv_ptr + v_off + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), COMPILED) * scale  # [QGP, BT]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, COMPILED)
        m = m_new
    return acc, m, lsum


@triton.jit
def _merge(ws_o, ws_m, ws_l, attn_ptr, rows, num_parts, P_MAX, D: tl.constexpr, PP: tl.constexpr):
    """Query heads ``rows [QG]``: their ``num_parts`` partitions' results merged, normalized, stored."""
    offs_p = tl.arange(0, PP)
    offs_d = tl.arange(0, D)
    mask = (offs_p < num_parts)[None, :]
    ml = rows[:, None] * P_MAX + offs_p[None, :]  # [QG, PP]
    m = tl.load(ws_m + ml, mask=mask, other=float("-inf"), cache_modifier=".cg")
    lsum = tl.load(ws_l + ml, mask=mask, other=0.0, cache_modifier=".cg")
    top = tl.max(m, axis=1)
    w = tl.where(mask, tl.exp(m - top[:, None]), 0.0)  # [QG, PP]
    o = tl.load(ws_o + ml[:, :, None] * D + offs_d[None, None, :], mask=mask[:, :, None], other=0.0,
                cache_modifier=".cg")  # fmt: skip
    out = tl.sum(w[:, :, None] * o, axis=1) / tl.sum(w * lsum, axis=1)[:, None]
    tl.store(attn_ptr + rows[:, None] * D + offs_d[None, :], out.to(attn_ptr.dtype.element_ty))


@triton.jit
def _store_new_kv(qkv_ptr, kv_ptr, v_off, bt_ptr, cos, sin, g, pos, HQ, HKV, D: tl.constexpr, BS: tl.constexpr,
                  COMPILED: tl.constexpr):  # fmt: skip
    """The new token's key (rotated) and value into the cache slot of ``pos``, seen by this program's loads after:
    a GPU-scope fence (the tile copies read the L2) and a CTA barrier, as ``kernels.decode_rope`` does."""
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, D)
    dtype = kv_ptr.dtype.element_ty
    k_new = _rotated(qkv_ptr + (HQ + g) * D, cos, sin, offs_d, HALF).to(dtype)
    v_new = tl.load(qkv_ptr + (HQ + HKV + g) * D + offs_d, cache_modifier=".cg")
    slot = (tl.load(bt_ptr + pos // BS).to(tl.int64) * BS + pos % BS) * (HKV * D) + g * D
    tl.store(kv_ptr + slot + offs_d, k_new)
    tl.store(kv_ptr + v_off + slot + offs_d, v_new.to(dtype))
    if COMPILED:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _attn_task(qkv_ptr, attn_ptr, kv_ptr, v_off, bt_ptr, cs_ptr, ws_o, ws_m, ws_l, head_cnt, g, part, pos,
               part_len, num_parts, scale, HQ, HKV, P_MAX, D: tl.constexpr, QG: tl.constexpr, BS: tl.constexpr,
               BT: tl.constexpr, PP: tl.constexpr, NUM_STAGES: tl.constexpr, COMPILED: tl.constexpr):  # fmt: skip
    """KV head ``g``'s partition ``part`` (none past ``num_parts``), then the merge if it arrives last."""
    HALF: tl.constexpr = D // 2
    QGP: tl.constexpr = 16 if QG < 16 else QG  # the MMA's M
    live = tl.arange(0, QGP) < QG
    rows = g * QG + tl.arange(0, QGP)
    offs_d = tl.arange(0, D)
    cos = tl.load(cs_ptr + pos * D + offs_d % HALF).to(tl.float32)
    sin = tl.load(cs_ptr + pos * D + HALF + offs_d % HALF).to(tl.float32)
    start = part * part_len
    if start <= pos:
        end = tl.minimum(start + part_len, pos + 1)
        if end == pos + 1:  # this partition holds the new token: its key and value into the cache first
            _store_new_kv(qkv_ptr, kv_ptr, v_off, bt_ptr, cos, sin, g, pos, HQ, HKV, D, BS, COMPILED)
        q_ptr = qkv_ptr + tl.where(live, rows, g * QG)[:, None] * D  # padding rows read the head's first, then zero
        q = tl.where(live[:, None], _rotated(q_ptr, cos[None, :], sin[None, :], offs_d[None, :], HALF), 0.0)
        acc, m, lsum = _attend(
            q.to(kv_ptr.dtype.element_ty), kv_ptr, v_off, bt_ptr, g, start, end, scale, HKV, D, BS, BT, NUM_STAGES,
            COMPILED,
        )  # fmt: skip
        ml = rows * P_MAX + part
        tl.store(ws_o + ml[:, None] * D + offs_d[None, :], acc, mask=live[:, None])
        tl.store(ws_m + ml, m, mask=live)
        tl.store(ws_l + ml, lsum, mask=live)
    tl.debug_barrier()  # every thread's partials before thread 0's release (kernels.int4_split.finish_tile)
    if tl.atomic_add(head_cnt, 1, sem="acq_rel") == P_MAX - 1:
        _merge(ws_o, ws_m, ws_l, attn_ptr, g * QG + tl.arange(0, QG), num_parts, P_MAX, D, PP)
