"""The attention tasks of the one-launch int4 decode step (``kernels.int4_decode_step``): one KV head's partition
of the positions, its query heads and new key rotated, the new key and value into the cache, an online softmax, and
the merge of the head's partitions by the last one to arrive. Its own module so the step's stays under ~400 lines."""

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
def _attend(q, k_new, v_new, kv_ptr, v_off, bt_ptr, g, start, end, pos, scale, HKV,
            D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """Positions ``[start, end)`` of KV head ``g`` for its query rows ``q [QG, D]``: the online softmax's
    ``(acc [QG, D], m [QG], lsum [QG])``; position ``pos`` is the new token, ``k_new`` / ``v_new`` ``[D]``."""
    QG: tl.constexpr = q.shape[0]
    offs_d = tl.arange(0, D)
    m = tl.full((QG,), float("-inf"), tl.float32)
    lsum = tl.zeros((QG,), tl.float32)
    acc = tl.zeros((QG, D), tl.float32)
    for t0 in tl.range(start, end, BT, num_stages=NUM_STAGES):
        t = t0 + tl.arange(0, BT)
        valid = t < end
        cached = valid & (t < pos)
        blk = tl.load(bt_ptr + t // BS, mask=valid, other=0)
        rows = (blk.to(tl.int64) * BS + t % BS) * (HKV * D) + g * D  # [BT] element offsets (int64: large caches)
        k = tl.load(kv_ptr + rows[:, None] + offs_d[None, :], mask=cached[:, None], other=0.0).to(tl.float32)
        v = tl.load(kv_ptr + v_off + rows[:, None] + offs_d[None, :], mask=cached[:, None], other=0.0)
        k = tl.where((t == pos)[:, None], k_new[None, :], k)
        v = tl.where((t == pos)[:, None], v_new[None, :], v.to(tl.float32))
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [QG, BT]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
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
def _attn_task(qkv_ptr, attn_ptr, kv_ptr, v_off, bt_ptr, cs_ptr, ws_o, ws_m, ws_l, head_cnt, g, part, pos,
               part_len, num_parts, scale, HQ, HKV, P_MAX, D: tl.constexpr, QG: tl.constexpr, BS: tl.constexpr,
               BT: tl.constexpr, PP: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """KV head ``g``'s partition ``part`` (none past ``num_parts``), then the merge if it arrives last."""
    HALF: tl.constexpr = D // 2
    rows = g * QG + tl.arange(0, QG)
    offs_d = tl.arange(0, D)
    cos = tl.load(cs_ptr + pos * D + offs_d % HALF).to(tl.float32)
    sin = tl.load(cs_ptr + pos * D + HALF + offs_d % HALF).to(tl.float32)
    dtype = attn_ptr.dtype.element_ty
    start = part * part_len
    if start <= pos:
        end = tl.minimum(start + part_len, pos + 1)
        q = _rotated(qkv_ptr + rows[:, None] * D, cos[None, :], sin[None, :], offs_d[None, :], HALF)
        k_new = _rotated(qkv_ptr + (HQ + g) * D, cos, sin, offs_d, HALF).to(dtype)
        v_new = tl.load(qkv_ptr + (HQ + HKV + g) * D + offs_d, cache_modifier=".cg")
        acc, m, lsum = _attend(
            q.to(dtype).to(tl.float32), k_new.to(tl.float32), v_new.to(tl.float32), kv_ptr, v_off, bt_ptr, g, start,
            end, pos, scale, HKV, D, BS, BT, NUM_STAGES,
        )  # fmt: skip
        if end == pos + 1:  # this partition holds the new token: its key and value into the cache
            slot = (tl.load(bt_ptr + pos // BS).to(tl.int64) * BS + pos % BS) * (HKV * D) + g * D
            tl.store(kv_ptr + slot + offs_d, k_new)
            tl.store(kv_ptr + v_off + slot + offs_d, v_new)
        ml = rows * P_MAX + part
        tl.store(ws_o + ml[:, None] * D + offs_d[None, :], acc)
        tl.store(ws_m + ml, m)
        tl.store(ws_l + ml, lsum)
    tl.debug_barrier()  # every thread's partials before thread 0's release (kernels.int4_split.finish_tile)
    if tl.atomic_add(head_cnt, 1, sem="acq_rel") == P_MAX - 1:
        _merge(ws_o, ws_m, ws_l, attn_ptr, rows, num_parts, P_MAX, D, PP)
