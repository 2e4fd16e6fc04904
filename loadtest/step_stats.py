"""What a wave's admission ramp does to the engine's steps: the steps between the wave's first request and the
moment every request had its first token, with their length, size and how many requests were decoding.

The engine alone gets a whole wave at once; through the stack the wave's requests reach the core over the
admission ramp (client, API, Redis, front), so the ramp's steps mix prefills of late arrivals into the decodes
of early ones. ITL p99 counts each such step once per request that was decoding in it: ``slow_gaps`` is that
count for steps longer than twice the engine's decode step, the number the 1 % tail of the gaps is made of.
"""

from __future__ import annotations

from typing import Any

from engine.step_trace import StepRecord
from loadtest.stream_client import Record


def wave_windows(records: list[Record]) -> list[dict[str, float]]:
    """Per wave (in order): first request sent, every request's first token in, last request done."""
    windows: dict[int, dict[str, float]] = {}
    for r in records:
        w = windows.setdefault(r.wave, {"start": r.start_s, "ramp_end": r.start_s, "end": r.end_s})
        w["start"] = min(w["start"], r.start_s)
        w["end"] = max(w["end"], r.end_s)
        if r.ttft_s is not None:
            w["ramp_end"] = max(w["ramp_end"], r.start_s + r.ttft_s)
    return [windows[k] for k in sorted(windows)]


def ramp_stats(steps: list[StepRecord], window: dict[str, float], step_s: float) -> dict[str, Any]:
    """The steps that began in ``window``'s ramp, against the engine's decode step ``step_s``."""
    ramp_at = [i for i, s in enumerate(steps) if window["start"] <= s.start <= window["ramp_end"]]
    ramp = [steps[i] for i in ramp_at]
    arrivals = [s for s in steps if window["start"] <= s.start <= window["end"] and s.num_added]
    # a step's decoding requests: those running after the step before it (a 1-step prefill has its first token
    # then); the requests it prefills are waiting for their first token, not in a gap
    decoding = [steps[i - 1].num_running if i > 0 else 0 for i in ramp_at]
    slow = [(s, n) for s, n in zip(ramp, decoding, strict=True) if s.duration_s > 2 * step_s]
    return {
        "ramp_ms": round((window["ramp_end"] - window["start"]) * 1e3, 1),
        "ramp_steps": len(ramp),
        "steps_ms": [round(s.duration_s * 1e3, 1) for s in ramp],
        "steps_tokens": [s.num_tokens for s in ramp],
        "steps_running": [s.num_running for s in ramp],
        "steps_added": [s.num_added for s in ramp],
        "core_arrival_span_ms": round((arrivals[-1].start - arrivals[0].start) * 1e3, 1) if arrivals else None,
        "slow_steps": len(slow),
        "slow_gaps": sum(n for _, n in slow),
    }


def decode_step_p50_ms(steps: list[StepRecord], windows: list[dict[str, float]]) -> float | None:
    """The median step after the ramps of ``windows`` (every request decoding, none added): the step the
    core itself took, without the hops after it, to set beside TPOT."""
    durations = sorted(
        s.duration_s
        for w in windows
        for s in steps
        if w["ramp_end"] < s.start <= w["end"] and not s.num_added and s.num_running
    )
    return round(durations[len(durations) // 2] * 1e3, 3) if durations else None


def level_ramps(steps: list[StepRecord], windows: list[dict[str, float]], step_ms: float | None) -> list[Any]:
    if not step_ms:
        return []
    return [ramp_stats(steps, w, step_ms / 1e3) for w in windows]


def format_ramps(side: str, level: int, ramps: list[dict[str, Any]]) -> str:
    lines = []
    for i, r in enumerate(ramps):
        lines.append(
            f"{side} c={level} wave {i}: ramp {r['ramp_ms']} ms, {r['ramp_steps']} steps, core arrivals over "
            f"{r['core_arrival_span_ms']} ms, {r['slow_steps']} steps > 2x step ({r['slow_gaps']} gaps); "
            f"ms {r['steps_ms']} tokens {r['steps_tokens']} running {r['steps_running']} added {r['steps_added']}"
        )
    return "\n".join(lines)


def print_ramps(res: dict[str, Any], min_level: int = 64) -> None:
    """Each level's median decode step on both sides, then the admission ramp's steps of every level from
    ``min_level`` on, the engine's and the stack's."""
    for eng, stack in zip(res["engine"]["levels"], res["stack"]["levels"], strict=False):
        print(
            f"decode step p50 c={eng['concurrency']}: engine {eng.get('decode_step_p50_ms')} ms, stack's core "
            f"{stack.get('decode_step_p50_ms')} ms; GPU after it (SM MHz, memory MHz, C, W): engine "
            f"{eng.get('gpu_state')}, stack {stack.get('gpu_state')}"
        )
    for side in ("engine", "stack"):
        for level in res.get(side, {}).get("levels", []):
            if level["concurrency"] >= min_level and level.get("ramps"):
                print(format_ramps(side, level["concurrency"], level["ramps"]))
