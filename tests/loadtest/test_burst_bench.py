"""``pagedserve bench burst``: a burst admitted through the API's script, taken by the real worker front."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.burst_bench import main


def test_burst_bench_hands_every_admitted_job_to_the_core_once(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    assert main(["--jobs", "12", "--runs", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["jobs"] == 12 and len(res["runs"]) == 2 and res["all_reached"]
    for run in res["runs"]:
        assert 0 < run["first_ms"] <= run["all_ms"] < 60e3 and run["us_per_job"] > 0


def test_burst_bench_through_the_api_queues_every_request(tmp_path: Path) -> None:
    out = tmp_path / "api.json"
    assert main(["--api", "--jobs", "8", "--runs", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["api_jobs"] == 8 and len(res["runs"]) == 2
    for run in res["runs"]:  # (arq's scores are whole ms: the first can read up to 1 ms before the send)
        assert -1 < run["first_ms"] <= run["all_ms"] < 30e3
    assert res["ms_per_request_median"] > 0
