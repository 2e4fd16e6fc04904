"""worker.stats_log: vLLM's periodic engine line from the heartbeats, on a clock the test moves (the e2e check of
the line in a running worker's log is tests/api/test_serve_cli.py)."""

from __future__ import annotations

import logging

import pytest

from wire.messages import WorkerHeartbeat
from worker.stats_log import LOG_STATS_INTERVAL_S, StatsLog, interval_from_env


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(**fields: float) -> WorkerHeartbeat:
    return WorkerHeartbeat("node-1", "m", 8, 64, **fields)  # type: ignore[arg-type]


def test_a_line_each_interval_with_the_interval_rates(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = StatsLog("node-1", 10.0, clock)
    caplog.set_level(logging.DEBUG, logger="worker.stats_log")
    assert log.observe(beat(prompt_tokens_total=50, generation_tokens_total=7)) is None  # starts the count
    clock.now += 9.9
    assert log.observe(beat(prompt_tokens_total=900)) is None  # not yet due
    clock.now += 0.1
    totals = {"prompt_tokens_total": 1050, "generation_tokens_total": 507, "prefix_cache_queries": 400}
    line = log.observe(beat(**totals, prefix_cache_hits=100, num_running=3, num_waiting=2, kv_cache_usage=0.0312))
    assert line == (
        "Engine node-1: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 25.0%"
    )
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, line)]
    clock.now += 20.0  # the next interval: 20 s, no lookups (the hit rate stays), requests swapped out
    totals = {"prompt_tokens_total": 1050, "generation_tokens_total": 907, "prefix_cache_queries": 400}
    line = log.observe(beat(**totals, prefix_cache_hits=100, num_swapped=1, cpu_kv_cache_usage=0.5))
    assert line is not None and "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 20.0 tokens/s" in line
    assert line.endswith("Prefix cache hit rate: 25.0%, Swapped: 1 reqs, CPU KV cache usage: 50.0%")


def test_info_while_working_and_once_after_then_debug(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = StatsLog("n", 1.0, clock)
    caplog.set_level(logging.DEBUG, logger="worker.stats_log")
    tokens = [0, 10, 20, 20, 20]  # generation totals at each beat: work, work, then idle
    for total in tokens:
        log.observe(beat(generation_tokens_total=total))
        clock.now += 1.0
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.INFO, logging.DEBUG]
    assert "Avg generation throughput: 0.0 tokens/s" in caplog.records[2].getMessage()


def test_waiting_requests_count_as_work(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = StatsLog("n", 1.0, clock)
    caplog.set_level(logging.DEBUG, logger="worker.stats_log")
    for _ in range(4):
        log.observe(beat(num_waiting=5))  # a queue the engine is not serving yet is worth an INFO line
        clock.now += 1.0
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 3


def test_interval_from_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    assert interval_from_env() == LOG_STATS_INTERVAL_S == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert interval_from_env() == 2.5
    for bad in ("0", "-1", "ten", "nan"):
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
            interval_from_env()
    with pytest.raises(ValueError, match="interval_s"):
        StatsLog("n", 0.0)
