"""Tensor parallelism end to end on CPU (gloo): one process per rank, rank 0 schedules and samples.
TP=2 and TP=4 give the same greedy tokens as TP=1, including a batch that preempts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.helpers import VOCAB_SIZE, build_tiny_model


def prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]} for n in (2, 9, 17, 33, 5, 26)]


def greedy_tokens(folder: Path, tp: int, **kwargs: object) -> tuple[list[list[int]], int]:
    llm = LLM(str(folder), device="cpu", tensor_parallel_size=tp, **kwargs)  # type: ignore[arg-type]
    try:
        outs = llm.generate(prompts(5), SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("family", "tp", "overrides"),
    [
        ("llama", 2, {}),
        ("llama", 4, {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}),
        ("qwen2", 2, {}),
        ("qwen2", 4, {}),  # 2 KV heads on 4 ranks: KV heads are replicated
    ],
)
def test_tp_equals_tp1(tmp_path: Path, family: str, tp: int, overrides: dict) -> None:
    folder = build_tiny_model(tmp_path, family, seed=11, **overrides)
    kwargs = {"block_size": 8, "num_gpu_blocks_override": 10, "max_model_len": 64, "max_num_batched_tokens": 32}
    expected, preempted_1 = greedy_tokens(folder, 1, **kwargs)
    got, preempted_n = greedy_tokens(folder, tp, **kwargs)
    assert preempted_1 > 0 and preempted_n > 0
    assert got == expected


def test_dead_rank_stops_the_engine_with_a_clear_error(tmp_path: Path) -> None:
    """Killing rank 1 must end rank 0 with an error, never a hang inside a collective."""
    import subprocess
    import sys
    import textwrap

    folder = build_tiny_model(tmp_path, "llama", seed=2)
    script = textwrap.dedent(
        f"""
        import os, signal, time
        from engine import LLM, SamplingParams
        llm = LLM({str(folder)!r}, device="cpu", tensor_parallel_size=2)
        os.kill(llm.engine.executor.procs[0].pid, signal.SIGKILL)
        for _ in range(100):
            llm.generate({{"prompt_token_ids": [5, 6, 7]}}, SamplingParams(max_tokens=50), use_tqdm=False)
            time.sleep(0.1)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rank" in proc.stderr and "died" in proc.stderr


def test_tp1_through_the_process_per_rank_path(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "qwen2", seed=12)
    expected, _ = greedy_tokens(folder, 1)
    llm = LLM(str(folder), device="cpu", distributed_executor_backend="mp")
    try:
        outs = llm.generate(prompts(5), SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()
