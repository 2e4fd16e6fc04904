"""``loadtest/int4_bench.py --tiny`` runs on CPU: the GEMM rows (Triton under the interpreter checked against the
reference) and batch-1 latency of a tiny random int4 model beside its dense twin."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.int4_bench import main


def test_int4_bench_tiny_mode(tmp_path: Path) -> None:
    out = tmp_path / "int4.json"
    assert main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["gemm"]) == 6 and all(float(r["rel_err"]) < 1e-4 for r in res["gemm"])
    assert res["int4"]["weight_gb"] < res["bf16"]["weight_gb"]
    assert res["int4"]["latency"]["tpot_ms"] > 0 and res["bf16"]["latency"]["tpot_ms"] > 0
