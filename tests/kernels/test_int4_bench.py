"""``loadtest/int4_bench.py --tiny`` runs on CPU: every variant of both paths of the sweep (fused GEMM and
dequant+matmul, Triton under the interpreter) checked against the reference at each M it applies to, each
dequantization bit for bit, and batch-1 latency of a tiny random int4 model beside its dense twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.int4_bench import DEQUANT_VARIANTS, M_VALUES_TINY, main
from loadtest.int4_gemm_sweep import LAYER_SHAPES_TINY, VARIANTS


@pytest.mark.slow
def test_int4_bench_tiny_mode(tmp_path: Path) -> None:
    out = tmp_path / "int4.json"
    assert main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["gemm"]
    assert len(rows) == len(LAYER_SHAPES_TINY) * len(M_VALUES_TINY)
    assert not any(r.get("wrong") or r.get("skipped") for r in rows)
    assert all(err < 1e-4 for r in rows for err in r["err"].values())
    ran = {name for r in rows for name in [*r["err"], *r["aliases"]]}
    every = {v.name for v in VARIANTS} | {v.name for v in DEQUANT_VARIANTS}
    assert ran == every  # every variant runs (or is an alias) somewhere
    assert all(all(r["dequant_exact"].values()) and len(r["dequant_exact"]) == len(DEQUANT_VARIANTS) for r in rows)
    assert res["int4"]["weight_gb"] < res["bf16"]["weight_gb"]
    assert res["int4"]["latency"]["tpot_ms"] > 0 and res["bf16"]["latency"]["tpot_ms"] > 0
