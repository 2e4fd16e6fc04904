"""``pagedserve bench soak`` for a few seconds against the real stack (default model): every process of the
stack is watched by role, Locust's numbers are read back, the plot is written, and no request failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.soak import main, slope_mb_per_min

pytestmark = pytest.mark.slow


def test_slope_is_least_squares_in_mb_per_minute() -> None:
    assert slope_mb_per_min([0, 30, 60], [100.0, 100.5, 101.0]) == pytest.approx(1.0)
    assert slope_mb_per_min([0, 60], [1.0, 2.0]) is None  # too few points to call it a trend


def test_soak_watches_every_role_and_counts_errors(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = ["--users", "4", "--spawn-rate", "4", "--duration-s", "5", "--sample-s", "1", "--max-tokens", "4"]
    status = main([*argv, "--out", str(out)])
    result = json.loads(out.read_text())
    assert status == 0, result["locust"]["failures"]
    roles = {key.split(":")[0] for key in result["summary"]["processes"]}
    assert {"launcher", "api", "worker-front", "engine-core", "redis"} <= roles
    assert result["locust"]["errors_other_than_429"] == 0
    assert sum(s["requests"] for s in result["locust"]["stats"].values()) > 0
    assert any(s["redis_used_mb"] for s in result["samples"])
    assert result["serve_exit_status"] == 0
    assert out.with_suffix(".png").stat().st_size > 10_000
