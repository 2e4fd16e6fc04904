"""The swap space's stats on their way out: the engine's step stats -> the worker heartbeat (in Redis) -> the
worker's Prometheus metrics, under vLLM v0's names where it had them and ``pagedserve:`` ones otherwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from arq.connections import RedisSettings, create_pool
from prometheus_client import CollectorRegistry

from engine import LLM, SamplingParams
from engine.core_messages import CoreStats
from tests.helpers import VOCAB_SIZE, build_tiny_model
from wire import keys
from wire.messages import WorkerHeartbeat
from worker.metrics import WorkerMetrics
from worker.node import WorkerNode
from worker.settings import WorkerSettings

LABELS = {"model_name": "m", "engine": "w1"}
BLOCK_SIZE = 8
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # the tiny Llama: layers x (K, V) x tokens x kv heads x head dim x fp32


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def test_worker_metrics_follow_the_heartbeats_swap_stats() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics("m", "w1", registry=registry)
    metrics.update(WorkerHeartbeat("w1", "m", 8, 2048))  # both kinds are exported from the start, at 0
    assert sample(registry, "pagedserve:num_preemptions_by_kind_total", kind="swap") == 0
    assert sample(registry, "pagedserve:num_preemptions_by_kind_total", kind="recompute") == 0
    beat = WorkerHeartbeat("w1", "m", 8, 2048, num_preemptions=3, num_swap_preemptions=2)
    beat.num_recompute_preemptions, beat.num_blocks_swapped_out, beat.num_blocks_swapped_in = 1, 10, 4
    beat.cpu_kv_cache_usage, beat.num_swapped = 0.25, 2
    metrics.update(beat)
    beat.num_preemptions, beat.num_swap_preemptions, beat.num_blocks_swapped_in = 5, 4, 10  # totals grow
    beat.cpu_kv_cache_usage, beat.num_swapped = 0.0, 0  # gauges follow the latest beat
    metrics.update(beat)
    assert sample(registry, "vllm:num_preemptions_total") == 5
    assert sample(registry, "pagedserve:num_preemptions_by_kind_total", kind="swap") == 4
    assert sample(registry, "pagedserve:num_preemptions_by_kind_total", kind="recompute") == 1
    assert sample(registry, "pagedserve:kv_blocks_swapped_out_total") == 10
    assert sample(registry, "pagedserve:kv_blocks_swapped_in_total") == 10
    assert sample(registry, "vllm:cpu_cache_usage_perc") == 0.0
    assert sample(registry, "vllm:num_requests_swapped") == 0
    beat.cpu_kv_cache_usage, beat.num_swapped = 0.5, 1
    metrics.update(beat)
    assert sample(registry, "vllm:cpu_cache_usage_perc") == 0.5
    assert sample(registry, "vllm:num_requests_swapped") == 1


def test_a_heartbeat_without_the_swap_fields_reads_as_no_swapping() -> None:
    """A worker of before the swap stats (rolling upgrade): its beat parses, the swap fields at their defaults."""
    old = {"worker_id": "w1", "model": "m", "capacity": 8, "max_model_len": 2048, "num_preemptions": 2}
    beat = WorkerHeartbeat.from_json(json.dumps(old))
    assert (beat.num_preemptions, beat.num_swap_preemptions, beat.num_blocks_swapped_out) == (2, 0, 0)
    assert (beat.cpu_kv_cache_usage, beat.num_swapped) == (0.0, 0)


class EngineNode(WorkerNode):
    """A worker node whose stats are an in-process engine's (the front reads the same ``CoreStats`` from its
    core process); it runs no jobs."""

    def __init__(self, llm: LLM, settings: WorkerSettings, redis: Any) -> None:
        super().__init__(settings, redis, "m", max_jobs=4, max_model_len=96)
        self.llm = llm
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics("m", settings.worker_id, registry=self.registry)

    async def generate(self, ctx: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def pump(self) -> None:
        raise NotImplementedError

    def core_stats(self) -> CoreStats:
        return self.llm.engine.stats()


@pytest.fixture(scope="module")
def swapped_llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Llama with 12 device blocks of 8 tokens, run on six 40-token prompts: they must be swapped out."""
    folder: Path = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=1)
    llm = LLM(
        str(folder),
        device="cpu",
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=12,
        max_model_len=96,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space=64 * BLOCK_BYTES / 2**30,
    )
    prompts = [[(7 * i + j) % (VOCAB_SIZE - 3) + 3 for j in range(40)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    yield llm
    llm.shutdown()


async def test_a_swapping_engines_heartbeat_carries_its_swaps(swapped_llm: LLM, redis_url: str) -> None:
    redis = await create_pool(RedisSettings.from_dsn(redis_url))
    node = EngineNode(swapped_llm, WorkerSettings(redis_url=redis_url, worker_id="w1"), redis)
    try:
        await node.beat()
        raw = await redis.get(keys.worker_key("w1"))
    finally:
        await redis.aclose()
    beat = WorkerHeartbeat.from_json(raw)
    stats = swapped_llm.engine.stats()
    assert beat.num_swap_preemptions == stats.num_swap_preemptions > 0
    assert beat.num_preemptions == beat.num_swap_preemptions + beat.num_recompute_preemptions
    assert beat.num_blocks_swapped_out == stats.num_blocks_swapped_out > 0
    assert beat.num_blocks_swapped_in == stats.num_blocks_swapped_in > 0
    assert (beat.num_swapped, beat.cpu_kv_cache_usage) == (0, 0.0)  # all finished: nothing left on the host
    registry = node.registry
    assert sample(registry, "pagedserve:num_preemptions_by_kind_total", kind="swap") == beat.num_swap_preemptions
    assert sample(registry, "pagedserve:kv_blocks_swapped_out_total") == beat.num_blocks_swapped_out
    assert sample(registry, "vllm:num_preemptions_total") == beat.num_preemptions
