"""``loadtest.swap_bench`` on the CPU with the tiny random shape: it runs, forces preemption, swaps, and every
preemption mode gives the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy import cli
from loadtest import swap_bench


@pytest.mark.slow  # ~20 s on 2 cores: the tiny shape's model, then four runs of six requests
def test_swap_bench_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "swap.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--workload", "random", "--num-requests", "6"]
    argv += ["--input-len", "16", "48", "--output-len", "24", "48", "--swap-space", "0.01", "--max-model-len", "256"]
    assert swap_bench.main([*argv, "--max-num-seqs", "6", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gpu_blocks"] * 3 <= result["blocks_needed"] and result["outputs_match"]
    runs = {r["mode"]: r for r in result["runs"]}
    assert runs["swap"]["preemptions_swap"] > 0 and runs["swap"]["blocks_swapped_in"] > 0
    assert runs["recompute"]["preemptions_recompute"] > 0 and runs["recompute"]["blocks_swapped_out"] == 0
    assert runs["recompute"]["computed_tokens"] > runs["swap"]["computed_tokens"]
    assert result["swap_path"]["swap_out_gb_s"] > 0
    for mode in ("recompute", "auto"):  # fp32: every mode's tokens are the first mode's, request by request
        assert result["agreement"][mode] == {"identical_requests": 6, "requests": 6, "mean_common_prefix": 1.0}


def test_pagedserve_bench_swap_is_the_swap_bench(capsys: pytest.CaptureFixture[str]) -> None:
    """``pagedserve bench swap`` reaches this bench's own flags (its run is the slow test above)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "swap", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--swap-space" in out and "--block-fraction" in out and "swap vs recompute" in out
