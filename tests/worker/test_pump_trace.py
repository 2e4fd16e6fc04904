"""The worker front's pump trace: off without its variable, a round trip with it (collector pauses included),
one file per front, and the per-wave numbers made from it."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest

from loadtest.hop_stats import front_hops
from worker.pump_trace import ENV_VAR, GcPause, PumpRecord, PumpTrace, front_path, read_pump_trace


def test_off_without_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert PumpTrace.from_env() is None


def test_round_trip_with_the_collector_pauses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "pump.jsonl"))
    trace = PumpTrace.from_env()
    assert trace is not None and trace.path == str(tmp_path / "pump.jsonl")
    received = time.perf_counter()
    sent = received - 0.001
    trace.record(received, steps=2, oldest_sent=sent, events=7, built=time.perf_counter())
    gc.collect()  # a full collection, seen by the trace's callback
    trace.write()
    assert trace._on_gc not in gc.callbacks  # written: the callback is gone
    records, pauses = read_pump_trace(str(tmp_path / "pump.jsonl"))
    assert [(r.steps, r.events) for r in records] == [(2, 7)]
    assert records[0].oldest_sent == sent and records[0].written >= records[0].built >= records[0].received
    assert any(p.generation == 2 and p.duration_s >= 0 for p in pauses)
    assert read_pump_trace(str(tmp_path / "missing.jsonl")) == ([], [])


def test_each_extra_front_writes_its_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "pump.jsonl"))
    trace = PumpTrace.from_env(front_index=2)
    assert trace is not None and trace.path == str(tmp_path / "pump.f2.jsonl") == str(
        front_path(tmp_path / "pump.jsonl", 2)
    )
    trace.write()


def test_front_hops_of_one_wave() -> None:
    window = {"start": 10.0, "ramp_end": 10.5, "end": 12.0}
    records = [
        PumpRecord(received=9.0, steps=1, oldest_sent=8.999, events=3, written=9.002),  # before the wave
        PumpRecord(received=10.1, steps=1, oldest_sent=10.099, events=4, written=10.102, built=10.101),
        PumpRecord(received=10.2, steps=3, oldest_sent=10.17, events=9, written=10.207, built=10.204, sent=10.206),
        PumpRecord(received=10.3, steps=0, oldest_sent=10.3, events=0, written=10.3),  # nothing from the core
    ]
    pauses = [GcPause(10.15, 0.004, 0), GcPause(11.0, 0.020, 2), GcPause(13.0, 1.0, 2)]
    hops = front_hops(records, pauses, window)
    assert hops["pumps"] == 2 and hops["steps"] == 4 and hops["max_steps_per_pump"] == 3
    assert hops["merged_pct"] == 50.0
    assert hops["core_to_front_p50_ms"] == pytest.approx(30.0) and hops["core_to_front_p99_ms"] == pytest.approx(30.0)
    assert hops["front_p50_ms"] == pytest.approx(7.0)  # the upper of the two: 2 and 7 ms
    assert hops["build_p50_ms"] == pytest.approx(4.0) and hops["build_p99_ms"] == pytest.approx(4.0)
    # the first record has no send time (an older trace): it went out when built, so it waited 0 ms
    assert hops["wait_p99_ms"] == pytest.approx(2.0) and hops["redis_p50_ms"] == pytest.approx(1.0)
    assert hops["core_to_sent_p50_ms"] == pytest.approx(36.0) and hops["core_to_sent_p99_ms"] == pytest.approx(36.0)
    assert hops["gc_pauses"] == 2 and hops["gc_full"] == 1
    assert hops["gc_total_ms"] == pytest.approx(24.0) and hops["gc_max_ms"] == pytest.approx(20.0)
    assert front_hops([], [], window)["merged_pct"] is None
