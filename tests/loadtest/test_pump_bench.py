"""``pagedserve bench pump``: the real worker front against a real redis-server, fed step messages."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.pump_bench import main


def test_pump_bench_writes_one_event_per_job_per_step(tmp_path: Path) -> None:
    out = tmp_path / "pump.json"
    assert main(["--jobs", "4", "--steps", "6", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["jobs"] == 4 and res["steps"] == 6 and res["events_per_step"] == 4
    assert 0 < res["front_ms_median"] <= res["front_ms_p90"] < 1e3
    assert abs(res["us_per_event_median"] - 1e3 * res["front_ms_median"] / 4) < 0.2  # (the median ms is rounded)
    # the final step: every job's last token and its final event in one pipeline, then every job returned
    assert res["final_build_ms"] > 0 and res["final_redis_ms"] > 0 and res["final_all_done_ms"] >= res["final_build_ms"]
