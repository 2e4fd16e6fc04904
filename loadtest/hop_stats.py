"""The worker front's part of a token's trip, per wave: from the core's send of a step to the front taking it
(core -> front), from there to its Redis pipeline returning (the front's own work and the write), how often the
front took several steps at once (it had fallen behind), and its garbage-collector pauses. Read from the front's
pump trace (``worker.pump_trace``); the API's part comes from its relay stamps (``stack_stats.relay_numbers``).
"""

from __future__ import annotations

from typing import Any

from worker.pump_trace import GcPause, PumpRecord, sent_at


def _pct_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def front_hops(records: list[PumpRecord], pauses: list[GcPause], window: dict[str, float]) -> dict[str, Any]:
    """The pump's records and collector pauses that began in ``window`` (a wave: ``start`` .. ``end``)."""
    pumps = [r for r in records if window["start"] <= r.received <= window["end"] and r.steps]
    gcs = [p for p in pauses if window["start"] <= p.start <= window["end"]]
    return {
        "pumps": len(pumps),
        "steps": sum(r.steps for r in pumps),
        "merged_pct": round(100 * sum(r.steps > 1 for r in pumps) / len(pumps), 2) if pumps else None,
        "max_steps_per_pump": max((r.steps for r in pumps), default=0),
        "core_to_front_p50_ms": _pct_ms([r.received - r.oldest_sent for r in pumps], 0.5),
        "core_to_front_p99_ms": _pct_ms([r.received - r.oldest_sent for r in pumps], 0.99),
        "front_p50_ms": _pct_ms([r.written - r.received for r in pumps], 0.5),
        "front_p99_ms": _pct_ms([r.written - r.received for r in pumps], 0.99),
        # a step's events are in Redis about when its pipeline goes out: the front's part of a token's latency
        "core_to_sent_p50_ms": _pct_ms([sent_at(r) - r.oldest_sent for r in pumps], 0.5),
        "core_to_sent_p99_ms": _pct_ms([sent_at(r) - r.oldest_sent for r in pumps], 0.99),
        "build_p50_ms": _pct_ms([r.built - r.received for r in pumps], 0.5),  # events built (CPU)
        "build_p99_ms": _pct_ms([r.built - r.received for r in pumps], 0.99),
        "wait_p99_ms": _pct_ms([sent_at(r) - r.built for r in pumps], 0.99),  # for the pipeline before it
        "redis_p50_ms": _pct_ms([r.written - sent_at(r) for r in pumps], 0.5),  # the pipeline's round trip
        "redis_p99_ms": _pct_ms([r.written - sent_at(r) for r in pumps], 0.99),
        "gc_pauses": len(gcs),
        "gc_total_ms": round(1e3 * sum(p.duration_s for p in gcs), 2),
        "gc_max_ms": round(1e3 * max((p.duration_s for p in gcs), default=0.0), 3),
        "gc_full": sum(p.generation == 2 for p in gcs),
    }


def level_hops(records: list[PumpRecord], pauses: list[GcPause], windows: list[dict[str, float]]) -> list[Any]:
    return [front_hops(records, pauses, w) for w in windows]


def format_hops(level: int, hops: list[dict[str, Any]]) -> str:
    lines = []
    for i, h in enumerate(hops):
        lines.append(
            f"front c={level} wave {i}: {h['pumps']} pipelines for {h['steps']} steps ({h['merged_pct']} % took "
            f"several, at most {h['max_steps_per_pump']}); core->front p50/p99 {h['core_to_front_p50_ms']}/"
            f"{h['core_to_front_p99_ms']} ms; front (events + pipeline) p50/p99 {h['front_p50_ms']}/"
            f"{h['front_p99_ms']} ms (build p50/p99 {h['build_p50_ms']}/{h['build_p99_ms']}, wait for the "
            f"previous pipeline p99 {h['wait_p99_ms']}, Redis p50/p99 {h['redis_p50_ms']}/{h['redis_p99_ms']}); "
            f"core->pipeline out p50/p99 {h['core_to_sent_p50_ms']}/{h['core_to_sent_p99_ms']} ms; GC {h['gc_pauses']} pauses, {h['gc_total_ms']} ms in all, longest "
            f"{h['gc_max_ms']} ms, {h['gc_full']} full"
        )
    return "\n".join(lines)
