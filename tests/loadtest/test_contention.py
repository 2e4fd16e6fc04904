"""``loadtest.contention`` on CPU: one tiny engine, both scheduling modes, with and without a busy process."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.contention import main


def test_every_configuration_reports_a_decode_step(tmp_path: Path) -> None:
    out = tmp_path / "contention.json"
    argv = ["--shape", "tiny", "--levels", "1", "3", "--burners", "0", "1", "--repeats", "1", "--output-len", "6"]
    assert main([*argv, "--max-model-len", "256", "--max-num-seqs", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    configs = {(r["burners"], r["async"], r["level"]) for r in rows}
    assert configs == {(b, a, lvl) for b in (0, 1) for a in (False, True) for lvl in (1, 3)}
    for row in rows:
        assert row["step_p50_ms"] is not None and row["step_p50_ms"] > 0
        assert row["device_span_p50_ms"] is None  # no CUDA here: steps only
