"""Swap-to-host preemption on a tiny random Llama (float32, CPU): with so few device blocks that requests must
be preempted, greedy output with swap == with recompute == with plenty of blocks == HF transformers, for prompts
of many lengths, n > 1 samples (shared blocks) and prefix-cache hits (some of them on blocks sitting on the host)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core_messages import CoreStats
from tests.engine.test_engine_parity import hf_greedy
from tests.helpers import VOCAB_SIZE, build_tiny_model

MAX_TOKENS = 12
BLOCK_SIZE = 8
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers x (K, V) x tokens x kv heads x head dim x float32
TIGHT = dict(block_size=BLOCK_SIZE, num_gpu_blocks_override=12, max_model_len=96, max_num_batched_tokens=64)


def make_rounds() -> tuple[list[list[int]], list[list[int]]]:
    """Round 1: ten prompts of 1..63 tokens. Round 2: prompts that extend round-1 prompts (prefix-cache hits,
    on the device or on the host) and two that extend each other."""
    rng = random.Random(2)
    first = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (1, 3, 7, 16, 17, 29, 40, 5, 63, 11)]
    tail = [rng.randrange(3, VOCAB_SIZE) for _ in range(9)]
    second = [first[8][:48] + tail, first[6] + tail[:3], first[5][:24] + tail[:5], first[3] + [7]]
    return first, second


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]], list[list[int]]]:
    folder = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=1)
    first, second = make_rounds()
    expected = hf_greedy(folder, first + second, MAX_TOKENS)
    return folder, first, second, expected


def run(folder: Path, first: list[list[int]], second: list[list[int]], **kwargs: object) -> tuple[list, CoreStats]:
    """Both rounds on one engine; round 1 asks n=2 of two prompts. Returns every sample's tokens and the stats."""
    llm = LLM(str(folder), device="cpu", **kwargs)  # type: ignore[arg-type]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    pair = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2)
    params = [pair if i in (4, 8) else greedy for i in range(len(first))]
    got = []
    for prompts, ps in ((first, params), (second, greedy)):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
        got += [[c.token_ids for c in o.outputs] for o in outs]
    stats = llm.engine.stats()
    assert llm.engine.kv.usage() == 0.0 and stats.cpu_kv_cache_usage == 0.0 and stats.num_swapped == 0
    llm.shutdown()
    return got, stats


def expected_samples(first: list[list[int]], expected: list[list[int]]) -> list[list[list[int]]]:
    return [[e, e] if i in (4, 8) else [e] for i, e in enumerate(expected)]


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(dict(num_gpu_blocks_override=256, block_size=BLOCK_SIZE), id="plenty"),
        pytest.param(dict(TIGHT, preemption_mode="recompute"), id="recompute"),
        pytest.param(dict(TIGHT, preemption_mode="swap", swap_space=256 * BLOCK_BYTES / 2**30), id="swap"),
        pytest.param(dict(TIGHT, swap_space=256 * BLOCK_BYTES / 2**30, async_scheduling=True), id="auto-async"),
        # 6 host blocks: some preemptions find the host pool full and recompute instead
        pytest.param(dict(TIGHT, preemption_mode="swap", swap_space=6 * BLOCK_BYTES / 2**30), id="swap-host-full"),
    ],
)
def test_greedy_output_is_the_same_whatever_the_preemption(
    case: tuple[Path, list[list[int]], list[list[int]], list[list[int]]], mode: dict[str, object]
) -> None:
    folder, first, second, expected = case
    got, stats = run(folder, first, second, **mode)
    assert got == expected_samples(first, expected)
    assert stats.prefix_cache_hits > 0
    if "swap_space" in mode:
        assert stats.num_swap_preemptions > 0
        assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in > 0
    if mode.get("preemption_mode") == "recompute":
        assert stats.num_recompute_preemptions > 0 and stats.num_swap_preemptions == 0
    if mode.get("swap_space") == 6 * BLOCK_BYTES / 2**30:
        assert stats.num_recompute_preemptions > 0  # the host pool was full
    assert stats.num_preemptions == stats.num_swap_preemptions + stats.num_recompute_preemptions


def test_tensor_parallel_ranks_swap_their_own_shards(
    case: tuple[Path, list[list[int]], list[list[int]], list[list[int]]],
) -> None:
    """At TP=2 every rank keeps the host copy of its K/V heads and runs the same swaps from the step's inputs."""
    folder, first, second, expected = case
    tp = dict(tensor_parallel_size=2, preemption_mode="swap", swap_space=256 * BLOCK_BYTES / 2 / 2**30)
    got, stats = run(folder, first, second, **TIGHT, **tp)
    assert got == expected_samples(first, expected)
    assert stats.num_swap_preemptions > 0 and stats.num_blocks_swapped_in > 0
