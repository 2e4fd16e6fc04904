"""The step trace round trip and the ramp numbers made from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.step_trace import ENV_VAR, StepRecord, StepTrace, read_trace
from loadtest.step_stats import decode_step_p50_ms, ramp_stats, wave_windows
from loadtest.stream_client import Record


def test_the_trace_is_off_without_its_variable_and_round_trips_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert StepTrace.from_env() is None
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "steps.jsonl"))
    trace = StepTrace.from_env()
    assert trace is not None
    trace.added()
    trace.added()
    trace.begin(100)
    trace.end(140, num_running=2, num_waiting=1)
    trace.begin(140)
    trace.end(142, num_running=2, num_waiting=0)
    trace.write()
    steps = read_trace(str(tmp_path / "steps.jsonl"))
    assert [(s.num_tokens, s.num_running, s.num_waiting, s.num_added) for s in steps] == [(40, 2, 1, 2), (2, 2, 0, 0)]
    assert steps[0].start <= steps[1].start and all(s.duration_s >= 0 for s in steps)
    assert read_trace(str(tmp_path / "missing.jsonl")) == []


def test_ramp_counts_the_decoding_requests_of_slow_steps_only() -> None:
    records = [Record(0, 0, ttft_s=0.05, start_s=1.0, end_s=2.0), Record(0, 1, ttft_s=0.2, start_s=1.01, end_s=2.1)]
    (window,) = wave_windows(records)
    assert window == {"start": 1.0, "ramp_end": pytest.approx(1.21), "end": 2.1}
    steps = [
        StepRecord(0.5, 0.01, 5, 1, 0, 1),  # before the wave
        StepRecord(1.0, 0.01, 20, 1, 1, 1),  # the first arrival's prefill: fast
        StepRecord(1.05, 0.05, 21, 2, 0, 1),  # 5x the step: the one running after the last step decodes
        StepRecord(1.10, 0.01, 2, 2, 0, 0),
        StepRecord(1.5, 0.01, 2, 2, 0, 0),  # after the ramp
    ]
    r = ramp_stats(steps, window, step_s=0.01)
    assert (r["ramp_steps"], r["slow_steps"], r["slow_gaps"]) == (3, 1, 1)
    # the engine alone: all at once, two budget-capped prefill steps; the second's decoders are the first's
    engine = [StepRecord(1.0, 0.05, 2048, 100, 156, 256), StepRecord(1.05, 0.05, 2048, 200, 56, 0)]
    assert ramp_stats(engine, {"start": 1.0, "ramp_end": 1.1, "end": 2.0}, step_s=0.01)["slow_gaps"] == 100
    assert r["steps_tokens"] == [20, 21, 2] and r["steps_added"] == [1, 1, 0]
    assert r["core_arrival_span_ms"] == pytest.approx(50.0)


def test_decode_step_median_is_taken_after_each_ramp() -> None:
    window = {"start": 1.0, "ramp_end": 1.2, "end": 2.0}
    steps = [
        StepRecord(1.1, 0.050, 40, 2, 0, 2),  # in the ramp
        StepRecord(1.3, 0.010, 2, 2, 0, 0),
        StepRecord(1.4, 0.012, 2, 2, 0, 0),
        StepRecord(1.5, 0.011, 2, 2, 0, 0),
        StepRecord(1.6, 0.030, 3, 3, 0, 1),  # a request joined: a prefill, not a decode step
        StepRecord(2.5, 0.100, 2, 2, 0, 0),  # after the wave
    ]
    assert decode_step_p50_ms(steps, [window]) == pytest.approx(11.0)
    assert decode_step_p50_ms(steps[:1], [window]) is None


def test_device_gaps_counts_overlapping_kernels_once() -> None:
    """PDL kernels overlap (no gap), a kernel inside a longer one adds none, and the gaps past 5 us (between two
    steps' graphs) are counted and listed."""
    from loadtest.step_profile import device_gaps

    spans = [(0.0, 10.0, "a"), (8.0, 20.0, "b"), (12.0, 15.0, "c"), (21.0, 30.0, "d"), (40.0, 50.0, "e"),
             (50.5, 60.0, "f")]  # fmt: skip
    gaps = device_gaps(list(reversed(spans)), steps=1)
    assert gaps == {
        "idle_us_per_step": 11.5,
        "gaps_over_5us_per_step": 1.0,
        "largest_gaps_us": [10.0, 1.0, 0.5],
        "long_gaps_by_kernels": {"d -> e": 10.0},
    }
