"""Where a launch of the one-launch int4 decode step spends its programs' time, from a traced launch
(``Int4DecodeStep.__call__(..., trace=)``: per task the GPU clock at the top of its iteration, after the claim,
after its wait and after its release, and the program and SM that ran it).

The answer to "why is it x times its floor": the share of all programs' time in claiming, waiting, working and
outside any task; the span the work would take packed perfectly onto the programs; per kind of task its median
wait and work, and the median handoff of the tasks that waited (from the release of the last task they waited for
to the end of their own wait: the cost of one synchronization); and per phase (a layer's tasks of one kind) the
time from its first task's start of work to its last task's end, with the bandwidth that gives for the phase's
bytes.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean, median
from typing import Any

from kernels.int4_decode_plan import Row
from kernels.int4_decode_step import ATTN, DOWN, GATE_UP, O_PROJ, QKV

KIND_NAMES = {QKV: "qkv", ATTN: "attn", O_PROJ: "o", GATE_UP: "gate_up", DOWN: "down"}
PROGRAM_SHIFT = 16  # the trace's last field: program id << 16 | SM id


def summarize(
    trace: list[list[int]], rows: list[Row], grid: int, layer_bytes: dict[int, int] | None = None
) -> dict[str, Any]:
    """``trace`` (a row a task, in table order: top, claimed, ready, end in ns, then program << 16 | SM) of the
    tasks ``rows``, run by ``grid`` programs. ``layer_bytes``: a layer's bytes per kind, for each phase's GB/s."""
    start = min(r[0] for r in trace)
    span = max(r[3] for r in trace) - start
    claim, wait, work = ([r[i + 1] - r[i] for r in trace] for i in range(3))
    in_tasks = sum(r[3] - r[0] for r in trace)
    total = grid * span
    out: dict[str, Any] = {
        "span_us": span / 1e3,
        "share": {
            "claim": sum(claim) / total,
            "wait": sum(wait) / total,
            "work": sum(work) / total,
            "outside": (total - in_tasks) / total,
        },
        "programs": len({r[4] >> PROGRAM_SHIFT for r in trace}),
        "sms": len({r[4] & ((1 << PROGRAM_SHIFT) - 1) for r in trace}),
        "packed_us": sum(work) / grid / 1e3,
    }
    handoff = _handoffs(trace, rows)
    by_kind: dict[int, list[int]] = defaultdict(list)
    phases: dict[tuple[int, int], list[int]] = defaultdict(list)
    for t, row in enumerate(rows):
        by_kind[row[0]].append(t)
        phases[row[1], row[0]].append(t)
    kinds: dict[str, Any] = {}
    for kind, ts in sorted(by_kind.items()):
        phase_ns = [
            max(trace[t][3] for t in tasks) - min(trace[t][2] for t in tasks)
            for (_, k), tasks in phases.items()
            if k == kind
        ]
        entry = {
            "tasks": len(ts),
            "wait_us_median": median(wait[t] for t in ts) / 1e3,
            "work_us_median": median(work[t] for t in ts) / 1e3,
            "claim_us_median": median(claim[t] for t in ts) / 1e3,
            "handoff_us_median": median(handoff[t] for t in ts if t in handoff) / 1e3
            if handoff.keys() & set(ts)
            else None,
            "phase_us_mean": mean(phase_ns) / 1e3,
            "phases_us_total": sum(phase_ns) / 1e3,
        }
        if layer_bytes and kind in layer_bytes:
            entry["phase_gb_s"] = layer_bytes[kind] / (mean(phase_ns) or 1)
        kinds[KIND_NAMES[kind]] = entry
    out["kinds"] = kinds
    return out


def _handoffs(trace: list[list[int]], rows: list[Row]) -> dict[int, int]:
    """Per task that waited (its wait longer than zero): the time from the release of the task that brought its
    wait counter to its target (the target-th release into that counter) to the end of its wait, in ns."""
    releases: dict[int, list[int]] = defaultdict(list)
    for t, row in enumerate(rows):
        releases[row[5]].append(trace[t][3])
    for ends in releases.values():
        ends.sort()
    out = {}
    for t, row in enumerate(rows):
        slot, target = row[3], row[4]
        if target and trace[t][2] > trace[t][1] and len(releases[slot]) >= target:
            out[t] = trace[t][2] - releases[slot][target - 1]
    return out


def lines(summary: dict[str, Any]) -> list[str]:
    """The summary as a few printable lines."""
    share = " ".join(f"{k} {v:.0%}" for k, v in summary["share"].items())
    head = (
        f"span {summary['span_us']:.1f} us ({summary['packed_us']:.1f} packed), {summary['programs']} programs on "
        f"{summary['sms']} SMs: {share}"
    )
    rows = [
        f"  {name:8s} {e['tasks']:5d} tasks  wait {e['wait_us_median']:6.2f}  work {e['work_us_median']:6.2f}  "
        f"claim {e['claim_us_median']:5.2f}"
        + (f"  handoff {e['handoff_us_median']:5.2f}" if e["handoff_us_median"] is not None else "")
        + f" us (medians)  phase {e['phase_us_mean']:6.2f} us"
        + (f" = {e['phase_gb_s']:.0f} GB/s" if "phase_gb_s" in e else "")
        for name, e in summary["kinds"].items()
    ]
    return [head, *rows]
