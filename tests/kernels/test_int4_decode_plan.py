"""The one-launch decode step's task tables (``kernels.int4_decode_plan``) against what each task reads and writes.

The interpreter runs the kernel's programs one after another, so it cannot show a missing wait; this can. On a GPU
any two tasks may run at once unless a chain of waits orders them. So two tasks that touch the same data, one of
them writing it, must be ordered by the waits, unless an atomic counter of their own orders them (the K ranges of
one split column tile, the partitions of one KV head). And every wait must count only tasks before it in the table,
and exactly as many as its target, or claiming in table order could deadlock.

``accesses`` is the kernel's data flow written out independently of the plan: the specification the tables are
checked against.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import defaultdict
from dataclasses import replace
from math import gcd
from pathlib import Path

import pytest
import torch

from kernels.int4_decode_plan import PROJS, StepShape, StepTiles, TaskPlan, cdiv, fit_tiles, plan_tasks
from kernels.int4_decode_step import ATTN, DOWN, GATE_UP, O_PROJ, QKV

Key = tuple[str, int]
EIGHT_B = (StepShape(32, 8, 128, 128, 1e-5, 0.1), 4096, 14336)
TINY = StepTiles(tn=16, bk=32, num_stages=1, parts=3, bt=16, splits=(2, 2, 1, 3))


class Model:
    """What each task of a plan reads and may write, in units of ``unit`` elements (dividing every tile, K range
    and head). ``streams=1``: the residual stream in one buffer (as the kernel had it before o_proj wrote ``h2``)."""

    def __init__(self, shape: StepShape, hidden: int, inter: int, tiles: StepTiles, plan: TaskPlan, streams: int):
        self.shape, self.hidden, self.inter, self.tiles, self.plan = shape, hidden, inter, tiles, plan
        self.hqd = shape.heads * shape.head_dim
        self.unit = gcd(tiles.tn // 2, tiles.bk, shape.head_dim)
        self.streams = ("h", "h2") if streams == 2 else ("h", "h")
        # each stream's columns times its next norm's weight, written with the stream (the kernel's ``g``)
        self.normed = ("g", "g2") if streams == 2 else ("g", "g")

    def span(self, buf: str, lo: int, hi: int) -> set[Key]:
        return {(buf, u) for u in range(lo // self.unit, cdiv(hi, self.unit))}

    def accesses(self, kind: int, layer: int, index: int) -> tuple[set[Key], set[Key], tuple[int, ...]]:
        """(reads, writes, sync): ``sync`` names the tasks that an atomic counter of their own orders."""
        if kind == ATTN:
            return self._attention(layer, index)
        h, h2 = self.streams
        g, g2 = self.normed
        split, tn = self.plan.splits[kind], self.tiles.tn
        tile, part = divmod(index, split)
        n = self.hqd + 2 * self.shape.kv_heads * self.shape.head_dim if kind == QKV else self.hidden
        k = {QKV: self.hidden, O_PROJ: self.hqd, GATE_UP: self.hidden, DOWN: self.inter}[kind]
        k_per = cdiv(cdiv(k, self.tiles.bk), split) * self.tiles.bk
        k_lo, k_hi = part * k_per, min(part * k_per + k_per, k)
        cols = (tile * tn, min(tile * tn + tn, n))
        if kind == QKV:  # the whole stream's 1 / rms, its K range of g
            reads, writes = self.span(h, 0, self.hidden) | self.span(g, k_lo, k_hi), self.span("qkv", *cols)
        elif kind == O_PROJ:
            reads = self.span("attn", k_lo, k_hi) | self.span(h, *cols)
            writes = self.span(h2, *cols) | self.span(g2, *cols)
        elif kind == GATE_UP:
            reads = self.span(h2, 0, self.hidden) | self.span(g2, k_lo, k_hi)
            cols = (tile * tn // 2, min(tile * tn // 2 + tn // 2, self.inter))
            writes = self.span("act", *cols)
        else:
            reads = self.span("act", k_lo, k_hi) | self.span(h2, *cols)
            writes = self.span(h, *cols) | self.span(g, *cols)
        if split > 1:  # the projection's own run of split-K sums and tile counters, left at zero by the last
            _, tile_at, gws_at = self.plan.proj[PROJS.index(kind)]
            writes |= self.span("gws", gws_at + cols[0], gws_at + cols[1]) | {("tile", tile_at + tile)}
            if kind == GATE_UP:  # up's columns, inter on
                writes |= self.span("gws", gws_at + self.inter + cols[0], gws_at + self.inter + cols[1])
        return reads, writes, (kind, layer, tile)

    def _attention(self, layer: int, index: int) -> tuple[set[Key], set[Key], tuple[int, ...]]:
        d, qg = self.shape.head_dim, self.shape.heads // self.shape.kv_heads
        g, part = divmod(index, self.tiles.parts)
        q = (g * qg * d, (g + 1) * qg * d)
        kv = self.hqd + g * d
        reads = self.span("qkv", *q) | self.span("qkv", kv, kv + d)
        reads |= self.span("qkv", kv + self.shape.kv_heads * d, kv + self.shape.kv_heads * d + d)
        # its partial results; the merge (by whichever partition arrives last) reads all of the head's
        parts = {("ws", g * self.tiles.parts + p) for p in range(self.tiles.parts)}
        writes = {("ws", g * self.tiles.parts + part), ("kv", layer * self.shape.kv_heads + g)}
        return reads | parts, writes | self.span("attn", *q), (ATTN, layer, g)


def problems(model: Model, rows: list[tuple[int, ...]]) -> list[str]:
    """What is wrong with ``rows``: waits that could deadlock or pass early, and unordered conflicting tasks."""
    found: list[str] = []
    producers = defaultdict(list)
    for t, row in enumerate(rows):
        producers[row[5]].append(t)
    n = len(rows)
    before = torch.zeros(n, n, dtype=torch.bool)  # before[b, a]: a happens before b
    reach: dict[int, torch.Tensor] = {}  # a wait slot's producers and everything before them
    for t, (_, _, _, slot, target, _) in enumerate(rows):
        if target == 0:
            continue
        ps = producers[slot]
        if len(ps) != target or max(ps) >= t:
            found.append(f"task {t} {rows[t]}: {len(ps)} tasks count into slot {slot}, the last at {max(ps)}")
            continue
        if slot not in reach:
            reach[slot] = before[ps].any(dim=0)
            reach[slot][ps] = True
        before[t] = reach[slot]
    users: dict[Key, list[tuple[int, bool]]] = defaultdict(list)
    keys: dict[tuple[int, ...], int] = {}
    sync = []
    for t, row in enumerate(rows):
        reads, writes, key = model.accesses(*row[:3])
        sync.append(keys.setdefault(key, len(keys)))
        for r in reads - writes:
            users[r].append((t, False))
        for w in writes:
            users[w].append((t, True))
    sync_ids = torch.tensor(sync)
    for res, use in users.items():
        ts = torch.tensor([t for t, _ in use])
        for w in (t for t, writes in use if writes):
            ordered = before[w, ts] | before[ts, w] | (sync_ids[ts] == sync_ids[w])
            if not bool(ordered.all()):
                other = int(ts[~ordered][0])
                found.append(f"{res}: task {w} {rows[w]} and task {other} {rows[other]} are not ordered")
                break
    return found


CASES = {
    "tiny": (StepShape(4, 2, 16, 32, 1e-5, 0.25), 64, 96, TINY, 3),
    "mha": (StepShape(4, 4, 16, 32, 1e-5, 0.25), 64, 96, TINY, 2),
    "mqa-hidden96": (StepShape(8, 1, 16, 32, 1e-5, 0.25), 96, 64, TINY, 2),
    "tiles-across-heads": (StepShape(4, 2, 16, 32, 1e-5, 0.25), 64, 96, replace(TINY, tn=32), 2),
    "8b": (*EIGHT_B, StepTiles(), 2),
    # 128-column tiles (one query head's columns a qkv tile), K split 4 / 8 / 1 / 8, 32 partitions
    "8b-tn128": (*EIGHT_B, StepTiles(tn=128, splits=(4, 8, 1, 8), parts=32), 2),
}


@pytest.mark.parametrize("fine_deps", [False, True], ids=["phases", "fine"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_every_conflict_is_ordered_by_the_waits(case: str, fine_deps: bool) -> None:
    shape, hidden, inter, tiles, layers = CASES[case]
    tiles = fit_tiles(shape, hidden, inter, replace(tiles, fine_deps=fine_deps))
    plan = plan_tasks(shape, hidden, inter, layers, tiles)
    assert problems(Model(shape, hidden, inter, tiles, plan, streams=2), plan.rows) == []


def test_fine_waits_are_narrower() -> None:
    """At the 8B shape every consumer of the fine table waits for part of the phase before it: attention for its
    KV head's 12 qkv column tiles (each split K ways), o_proj's K ranges for their KV heads' partitions, down_proj's
    K ranges for their share of gate_up."""
    shape, hidden, inter = EIGHT_B
    coarse, fine = (plan_tasks(shape, hidden, inter, 1, StepTiles(fine_deps=f)) for f in (False, True))
    waits = lambda plan, kind: sorted({r[4] for r in plan.rows if r[0] == kind})  # noqa: E731
    parts, (s_qkv, s_o, s_gate_up, s_down) = StepTiles().parts, StepTiles().splits
    assert waits(coarse, QKV) == waits(fine, QKV) == [0]  # the first layer's qkv waits for nothing
    assert (waits(coarse, ATTN), waits(fine, ATTN)) == ([96 * s_qkv], [(4 + 1 + 1) * 2 * s_qkv])
    assert (waits(coarse, O_PROJ), waits(fine, O_PROJ)) == ([8 * parts], [8 * parts // s_o])
    assert (waits(coarse, DOWN), waits(fine, DOWN)) == ([448 * s_gate_up], [448 * s_gate_up // s_down])
    assert waits(fine, GATE_UP) == [64 * s_o]  # the whole stream: every o_proj task
    o_needs = [r[3] for r in fine.rows if r[0] == O_PROJ]
    assert o_needs == sorted(o_needs)  # claimed in the order their heads finish


def test_one_stream_buffer_needs_the_phase_barriers() -> None:
    """The check finds what the second stream buffer fixes: with fine waits, o_proj's first quarter would write the
    stream while later KV heads' qkv tiles still read it. The phase-wide waits order them."""
    shape, hidden, inter, tiles, layers = CASES["tiny"]
    fine = plan_tasks(shape, hidden, inter, layers, replace(tiles, fine_deps=True))
    found = problems(Model(shape, hidden, inter, tiles, fine, streams=1), fine.rows)
    assert any("('h'," in f for f in found) and any("('g'," in f for f in found), found  # the stream and g with it
    coarse = plan_tasks(shape, hidden, inter, layers, replace(tiles, fine_deps=False))
    assert problems(Model(shape, hidden, inter, tiles, coarse, streams=1), coarse.rows) == []


def test_finds_a_wrong_wait() -> None:
    """The check can fail: a target one short (the wait could pass before its last producer), a wait on a later
    task, and o_proj's first quarter waiting for the second quarter's heads."""
    shape, hidden, inter, tiles, layers = CASES["tiny"]
    tiles = replace(tiles, fine_deps=True)
    plan = plan_tasks(shape, hidden, inter, layers, tiles)
    model = Model(shape, hidden, inter, tiles, plan, streams=2)
    rows = [list(r) for r in plan.rows]
    short = [r[:] for r in rows]
    short[-1][4] -= 1
    assert "count into slot" in problems(model, [tuple(r) for r in short])[0]
    ahead = [r[:] for r in rows]
    ahead[0][3:5] = [rows[-1][5], sum(r[5] == rows[-1][5] for r in rows)]  # the last layer's down_proj
    assert "the last at" in problems(model, [tuple(r) for r in ahead])[0]
    first_o = next(i for i, r in enumerate(rows) if r[0] == O_PROJ)
    swapped = [r[:] for r in rows]
    second = next(r for r in rows if r[0] == O_PROJ and r[3] != rows[first_o][3])
    swapped[first_o][3] = second[3]
    found = problems(model, [tuple(r) for r in swapped])
    assert any("('attn'," in p and f"task {first_o} " in p for p in found), found


def test_the_device_stage_tiles_fit_the_8b_model() -> None:
    """Stage ds's tile settings (``loadtest/gpu_session.sh``, DS_TILES) are StepTiles that fit the 8B model as they
    are, and their tables pass the check: a typo there would cost a device call."""
    script = (Path(__file__).parents[2] / "loadtest" / "gpu_session.sh").read_text()
    words = shlex.split(re.search(r"DS_TILES:-(.*?)\} 2>&1", script, re.S).group(1).replace("\\\n", " "))  # type: ignore[union-attr]
    assert len(words) >= 4, words
    shape, hidden, inter = EIGHT_B
    for word in words:
        tiles = StepTiles(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(word).items()})
        assert fit_tiles(shape, hidden, inter, tiles) == tiles, word
        plan = plan_tasks(shape, hidden, inter, 2, tiles)
        assert problems(Model(shape, hidden, inter, tiles, plan, streams=2), plan.rows) == [], word
