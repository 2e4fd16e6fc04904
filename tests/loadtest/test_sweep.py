"""The concurrency sweep on a tiny random checkpoint on CPU: every level runs its requests to the end, the
numbers are consistent with each other, and the plot is a real PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from loadtest.sweep import plot_sweep, run_level, run_sweep
from tests.helpers import build_tiny_model


def test_sweep_levels_and_plot(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "llama", seed=5)
    config = EngineConfig(
        model=ModelConfig(model=str(folder), max_model_len=128, skip_tokenizer_init=True),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),  # 8 x 10 prompt tokens: 4 steps
        device="cpu",
    )
    engine = Engine(config)
    try:
        points = run_sweep(engine, [1, 8, 4], prompt_len=10, output_len=6)
        with pytest.raises(ValueError, match="max_num_seqs"):
            run_level(engine, 16, 10, 6)
    finally:
        engine.shutdown()
    assert [p["concurrency"] for p in points] == [1, 4, 8]
    for p in points:
        assert 0 < p["all_started_s"] < p["elapsed_s"] and p["tpot_ms"] > 0
        assert p["output_tok_s"] == pytest.approx(p["concurrency"] * 6 / p["elapsed_s"], rel=1e-2)
    assert [p["start_steps"] for p in points] == [1, 2, 4]  # 10, 40, 80 prompt tokens under a 24-token budget
    png = plot_sweep(points, str(tmp_path / "sweep.png"), "tiny", floor_ms=1.0)
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
