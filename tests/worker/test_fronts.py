"""How a worker node splits its jobs between its fronts (no processes: the arithmetic and the auto count)."""

from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from worker.fronts import front_settings, num_fronts, share
from worker.settings import WorkerSettings


@pytest.mark.parametrize(("total", "parts"), [(512, 4), (7, 3), (1, 1), (256, 2), (5, 5)])
def test_shares_sum_to_the_total_and_differ_by_at_most_one(total: int, parts: int) -> None:
    shares = [share(total, parts, k) for k in range(parts)]
    assert sum(shares) == total and max(shares) - min(shares) <= 1


def test_front_settings_split_the_jobs_and_keep_metrics_on_front_0() -> None:
    base = WorkerSettings(worker_id="node", metrics_port=9100)
    fronts = [front_settings(base, 510, 4, k) for k in range(4)]
    assert [f.max_jobs for f in fronts] == [128, 128, 127, 127]
    assert [f.worker_id for f in fronts] == ["node", "node-f1", "node-f2", "node-f3"]
    assert [f.metrics_port for f in fronts] == [9100, None, None, None]
    only = front_settings(WorkerSettings(worker_id="solo", max_jobs=8), 510, 1, 0)
    assert (only.max_jobs, only.worker_id) == (8, "solo")  # an explicit max_jobs is the node's total


def test_auto_count(monkeypatch: pytest.MonkeyPatch) -> None:
    def config(device: str, max_num_seqs: int) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=""), scheduler=SchedulerConfig(max_num_seqs=max_num_seqs), device=device
        )

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert num_fronts(WorkerSettings(), config("cpu", 512)) == 1  # the CPU engine needs the cores itself
    assert num_fronts(WorkerSettings(), config("cuda", 512)) == 4
    assert num_fronts(WorkerSettings(), config("cuda", 256)) == 2
    assert num_fronts(WorkerSettings(), config("cuda", 64)) == 1
    assert num_fronts(WorkerSettings(fronts=3), config("cpu", 8)) == 3  # asked for: given
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert num_fronts(WorkerSettings(), config("cuda", 512)) == 1  # a quarter of the cores at most
    with pytest.raises(ValueError, match="fronts"):
        WorkerSettings(fronts=-1)
