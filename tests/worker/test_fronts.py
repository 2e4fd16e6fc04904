"""How a worker node splits its jobs between its fronts (no processes: the arithmetic)."""

from __future__ import annotations

import pytest

from worker.fronts import front_settings, share
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
    assert [f.log_stats for f in fronts] == [True, False, False, False]  # one stats line a node
    assert not any(f.log_stats for f in (front_settings(WorkerSettings(log_stats=False), 510, 2, k) for k in range(2)))
    only = front_settings(WorkerSettings(worker_id="solo", max_jobs=8), 510, 1, 0)
    assert (only.max_jobs, only.worker_id) == (8, "solo")  # an explicit max_jobs is the node's total


def test_fronts_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="fronts"):
        WorkerSettings(fronts=0)
