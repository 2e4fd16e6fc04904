"""The plan of the one-launch int4 decode step (``kernels.int4_decode_step``): its launch choices, and the task
table and counters they give for a model's shape. Host code only, no tensors: which tasks a layer has, the order
programs claim them in, which counter each task waits on and which one it counts itself into.

Each layer's five kinds of tasks (qkv, attention, o, gate_up, down) form a chain: a task waits for tasks of the kind
before it. By default (``StepTiles.fine_deps``) it waits only for those that write what it reads, where the tiles
allow; without, for all of them (one counter a phase):

- attention for KV head ``g``: the qkv column tiles of its query heads, its key and its value;
- o_proj's ``i``-th K range: the attention heads whose outputs that range reads;
- down_proj's ``i``-th K range: the gate_up tiles that write those columns of ``silu(gate) * up``.

qkv and gate_up still wait for every task before them: they normalize the whole residual stream.
``tests/kernels/test_int4_decode_plan.py`` checks every such table against what each task reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kernels.int4_decode_step import ATTN, DOWN, GATE_UP, O_PROJ, QKV

ORDER = (QKV, ATTN, O_PROJ, GATE_UP, DOWN)  # a layer's kinds, in the order of its chain
BEFORE = {QKV: DOWN, ATTN: QKV, O_PROJ: ATTN, GATE_UP: O_PROJ, DOWN: GATE_UP}  # the kind a kind waits for
PROJS = (QKV, O_PROJ, GATE_UP, DOWN)  # the GEMV kinds, in the order of ``StepTiles.splits``


@dataclass(frozen=True)
class StepShape:
    heads: int
    kv_heads: int
    head_dim: int
    group_size: int
    eps: float
    scale: float


@dataclass(frozen=True)
class StepTiles:
    """Launch choices (swept on the H200 in Sessions 27-28, docs/benchmarks.md): ``tn`` output columns a GEMV
    task, ``bk`` k's a loop step (dividing the group), ``parts`` attention partitions a KV head (the context split
    over them), ``bt`` keys a step of their loops, ``num_stages`` loads in flight in both loops, programs per SM, and
    K split over ``splits`` tasks per projection (qkv, o, gate_up, down)."""

    # first guessed from the byte counts (64 columns x 128 k's of int4 is 4 KB a load, 4 in flight a program, 2
    # programs an SM; splits give every phase ~200 tasks). 8 stages, 32 columns and 3-4 programs an SM lost to them
    # (Sessions 27-28; in Session 31 a third program an SM was never resident beside the two: 4.77 against 4.16 ms);
    # 32 partitions won in Sessions 27 and 31 (3.90 / 4.48 ms at 128 / 4,096 tokens against 4.16 / 4.74 with 16:
    # attention's 128 tasks left half of the 264 programs idle); K splits (8, 8, 1, 8) won in Session 32 (3.19 / 3.70
    # ms against (2, 4, 1, 4)'s 3.91 / 4.49 on the same machine; (4, 8, 1, 8) 3.23 / 3.85, more splits or a split gate_up
    # lost): more tasks for qkv, o and down, so each phase's tasks start while the last phase's are still running.
    # The GEMVs on the tensor cores (~2.7 SASS instructions a weight at 128 columns against ~5.5) made the step 1.9x
    # slower on the H200 (8.01 against 4.16 ms at 128 tokens, Session 31) and were removed
    tn: int = 64
    bk: int = 128
    num_stages: int = 4
    parts: int = 32
    bt: int = 16
    programs_per_sm: int = 2
    splits: tuple[int, int, int, int] = (8, 8, 1, 8)
    # wait only for the tasks that write what a task reads (the module docstring), not for whole phases: 3-18 % faster
    # on the H200 (docs/benchmarks.md, Session 27)
    fine_deps: bool = True
    # warps a program, and a register cap a thread (0: none; ptxas's count, 214 at 4 warps with Triton 3.7, leaves
    # room for two programs an SM). More warps an SM lost on an H100 (Session 32, 128 tokens, the defaults 3.33 ms):
    # 8 warps capped at 128 registers 4.24, 4 programs of 128 registers 4.29, 3 of 160 3.78, one program of 8 warps
    # 5.74. So more warps to issue from did not pay; the caps spill (92-108 bytes, outside the inner loops)
    num_warps: int = 4
    maxnreg: int = 0


def fit_tiles(shape: StepShape, hidden: int, inter: int, tiles: StepTiles = StepTiles()) -> StepTiles:
    """``tiles`` for a model they may not fit: ``bk`` at most the group's largest power-of-two divisor, each split
    at most its projection's K / bk."""
    bk = min(tiles.bk, shape.group_size & -shape.group_size)
    ks = proj_ks(hidden, inter, shape.heads * shape.head_dim)
    splits = tuple(max(1, min(s, k // bk)) for s, k in zip(tiles.splits, ks, strict=True))
    return replace(tiles, bk=bk, splits=splits)  # type: ignore[arg-type]


def proj_ks(hidden: int, inter: int, hqd: int) -> tuple[int, int, int, int]:
    """The input features of qkv, o, gate_up and down (the order of ``StepTiles.splits``)."""
    return hidden, hqd, hidden, inter


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


Row = tuple[int, int, int, int, int, int]  # kind, layer, index, wait slot, wait target, done slot


@dataclass(frozen=True)
class TaskPlan:
    """The table and the counters' layout. ``cnt`` holds the wait counters (slots below ``head_slots``), the heads'
    arrival counters (one a layer and KV head), each projection's column tiles' counters (from ``tile_slots``), then
    the claim and exit counters."""

    rows: list[Row]  # in the order programs claim them
    col_tiles: dict[int, int]  # column tiles a projection (a gate_up tile: tn / 2 columns of gate and of up)
    splits: dict[int, int]  # K ranges a projection's column tile
    head_slots: int
    tile_slots: int
    proj: list[tuple[int, int, int]]  # per projection in PROJS order: split, its first tile counter, first gws element
    gws_size: int  # fp32 elements of the split-K sums (each projection its own columns)
    num_counters: int


def plan_tasks(shape: StepShape, hidden: int, inter: int, num_layers: int, tiles: StepTiles) -> TaskPlan:
    """The step's tasks for ``num_layers`` layers of ``shape``; a task waits on its wait slot reaching its target,
    which is the number of tasks counting into that slot."""
    hqd = shape.heads * shape.head_dim
    widths = {QKV: hqd + 2 * shape.kv_heads * shape.head_dim, O_PROJ: hidden, GATE_UP: 2 * inter, DOWN: hidden}
    col_tiles = {kind: cdiv(n, tiles.tn) for kind, n in widths.items()}
    splits = dict(zip(PROJS, tiles.splits, strict=True))
    tasks = _phase_tasks(shape, hidden, inter, tiles, col_tiles, splits)
    groups = {kind: max(g for _, g, _ in ts) + 1 for kind, ts in tasks.items()}
    sizes = {kind: [sum(1 for _, g, _ in ts if g == n) for n in range(groups[kind])] for kind, ts in tasks.items()}
    base = {(layer, kind): 0 for layer in range(num_layers) for kind in ORDER}
    slots = 0
    for layer, kind in base:
        base[layer, kind], slots = slots, slots + groups[kind]
    rows: list[Row] = []
    for layer in range(num_layers):
        for kind in ORDER:
            wait_layer, prev = (layer - 1 if kind == QKV else layer), BEFORE[kind]
            for index, group, need in tasks[kind]:
                slot, target = (0, 0) if wait_layer < 0 else (base[wait_layer, prev] + need, sizes[prev][need])
                rows.append((kind, layer, index, slot, target, base[layer, kind] + group))
    tile_at = [sum(col_tiles[k] for k in PROJS[:i]) for i in range(len(PROJS))]
    gws_at = [sum(widths[k] for k in PROJS[:i]) for i in range(len(PROJS))]
    head_slots = slots
    tile_slots = head_slots + num_layers * shape.kv_heads
    return TaskPlan(
        rows, col_tiles, splits, head_slots, tile_slots,
        [(splits[k], tile_at[i], gws_at[i]) for i, k in enumerate(PROJS)], sum(widths.values()),
        tile_slots + sum(col_tiles.values()) + 2,
    )  # fmt: skip


def _phase_tasks(
    shape: StepShape, hidden: int, inter: int, tiles: StepTiles, col_tiles: dict[int, int], splits: dict[int, int]
) -> dict[int, list[tuple[int, int, int]]]:
    """Per kind its tasks ``(index, group, need)`` in claiming order: ``group``, the counter of its kind it counts
    into; ``need``, the counter of the kind before it that it waits for. A GEMV task's index is ``tile * split +
    range``, an attention task's ``kv_head * parts + partition``."""
    d, hkv, tn, parts = shape.head_dim, shape.kv_heads, tiles.tn, tiles.parts
    hqd, qg = shape.heads * d, shape.heads // hkv
    s_qkv, s_o, s_gu, s_down = (splits[k] for k in PROJS)
    fine = tiles.fine_deps
    # a qkv column tile serves one KV head where tiles do not cross heads
    qkv_fine = fine and d % tn == 0
    # o's K ranges cover whole KV heads' query heads where the heads divide among them (and bk divides each)
    o_fine = fine and s_o > 1 and hkv % s_o == 0 and (hqd // s_o) % tiles.bk == 0
    # down's K ranges cover whole gate_up tiles (tn / 2 columns of silu(gate) * up each)
    down_k = inter // s_down
    down_fine = fine and s_down > 1 and inter % s_down == 0 and down_k % tiles.bk == 0 and down_k % (tn // 2) == 0

    def kv_head(col: int) -> int:  # the KV head a qkv column serves: its query heads, then k, then v
        return col // (qg * d) if col < hqd else (col - hqd) // d % hkv

    tasks = {
        QKV: [(i, kv_head(i // s_qkv * tn) if qkv_fine else 0, 0) for i in range(col_tiles[QKV] * s_qkv)],
        ATTN: [
            (i, i // parts // (hkv // s_o) if o_fine else 0, i // parts if qkv_fine else 0) for i in range(hkv * parts)
        ],
        O_PROJ: [(i, 0, i % s_o if o_fine else 0) for i in range(col_tiles[O_PROJ] * s_o)],
        GATE_UP: [
            (i, i // s_gu * (tn // 2) // down_k if down_fine else 0, 0) for i in range(col_tiles[GATE_UP] * s_gu)
        ],
        DOWN: [(i, 0, i % s_down if down_fine else 0) for i in range(col_tiles[DOWN] * s_down)],
    }
    # a kind's tasks in the order their inputs complete, then grouped by the counter they feed
    return {kind: sorted(ts, key=lambda t: (t[2], t[1], t[0])) for kind, ts in tasks.items()}
