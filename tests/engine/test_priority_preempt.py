"""Priority policy that preempts: a waiting request that does not fit takes the place of running requests of lower
priority (larger value, as vLLM), by swap or recompute; equal priorities never preempt each other."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache.swap import SwapKVCacheManager
from engine import LLM, SamplingParams
from engine.config import SchedulerConfig
from engine.engine import Engine
from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.engine.test_scheduler import make_request, make_scheduler, run_step
from tests.helpers import build_tiny_model

BLOCK_SIZE = 4
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # the tiny model's K/V per block (float32)


def test_a_higher_priority_arrival_preempts_at_the_sequence_cap() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    for i in range(2):
        sched.add_request(make_request(f"low{i}", 5, start=10 * i + 10, priority=1))
    run_step(sched)
    sched.add_request(make_request("same", 5, start=60, priority=1))
    run_step(sched)
    assert sched.requests["same"].status == RequestStatus.WAITING  # equal priority: FCFS, no preemption
    sched.add_request(make_request("high", 5, start=80, priority=0))
    out = run_step(sched)
    assert "high" in [c.request.request_id for c in out.chunks] and out.num_preempted == 1
    assert sched.requests["low1"].status == RequestStatus.PREEMPTED  # the newest of the lowest priority
    assert [r.request_id for r in sched.waiting] == ["low1", "same"]  # back before the later arrival
    while sched.num_unfinished:
        run_step(sched)
    assert all(r.num_output_tokens == 8 for r in sched.requests.values())


def test_a_higher_priority_arrival_swaps_out_lower_ones_when_blocks_run_out() -> None:
    kv = SwapKVCacheManager(8, 4, 16)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy="priority", preemption_mode="swap")
    sched = Scheduler(config, kv, 1024)
    for i in range(2):
        sched.add_request(make_request(f"low{i}", 15, start=20 * i + 10, priority=1))  # 4 blocks each
    run_step(sched)
    assert kv.num_free_blocks == 0
    sched.add_request(make_request("high", 6, start=90, priority=0))
    out = run_step(sched)
    assert [c.request.request_id for c in out.chunks] == ["low0", "high"]
    assert sched.requests["low1"].status == RequestStatus.SWAPPED and len(out.blocks_to_swap_out) == 4
    assert sched.num_swap_preemptions == 1


def test_fcfs_a_swapped_request_keeps_its_place_and_its_computed_tokens() -> None:
    kv = SwapKVCacheManager(5, 4, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="swap"), kv, 1024)
    sched.add_request(make_request("a", 7, start=10, max_tokens=6))
    sched.add_request(make_request("b", 7, start=50, max_tokens=6))
    run_step(sched)
    run_step(sched)  # 8 tokens each: 4 blocks held, 1 free
    out = run_step(sched)  # both need a third block: b (the newest) is swapped out
    b = sched.requests["b"]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8 and len(out.blocks_to_swap_out) == 2
    sched.add_request(make_request("c", 3, start=90, max_tokens=2))  # a later arrival that would fit now
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    while not b.block_ids:
        out = run_step(sched)
        assert sched.requests["c"].status == RequestStatus.WAITING or b.block_ids  # never ahead of b
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("b", 1), ("c", 3)]  # b resumes
    # b's two full blocks were still cached on the device when it came back: taken there, nothing copied
    assert out.blocks_to_swap_in == [] and kv.swap_stats.num_blocks_deduplicated == 2
    while sched.num_unfinished:
        run_step(sched)
    assert [sched.requests[r].num_output_tokens for r in "abc"] == [6, 6, 2] and kv.host_usage() == 0.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=4)


PROMPTS = {f"low{i}": list(range(20 + 17 * i, 36 + 17 * i)) for i in range(4)}  # 16 tokens: 4 full blocks each
HIGH = list(range(200, 211))
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def collect(engine: Engine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def reference(folder: Path) -> dict[str, list[int]]:
    llm = LLM(str(folder), device="cpu", block_size=BLOCK_SIZE, num_gpu_blocks_override=256)
    prompts = [*PROMPTS.values(), HIGH]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return dict(zip([*PROMPTS, "high"], [o.outputs[0].token_ids for o in outs], strict=True))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_priority_zero_starts_within_one_step_and_the_preempted_finish_unchanged(folder: Path, mode: str) -> None:
    swap = {"swap_space": 64 * BLOCK_BYTES / 2**30} if mode == "swap" else {}
    llm = LLM(
        str(folder),
        device="cpu",
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=16,  # the four prompts take all of them
        scheduling_policy="priority",
        preemption_mode=mode,
        **swap,  # type: ignore[arg-type]
    )
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, PARAMS, priority=1)
    collect(engine, tokens)  # the four prefills: every block is held
    assert len(engine.scheduler.running) == 4 and engine.kv.num_free_blocks == 0
    engine.add_request("high", HIGH, PARAMS, priority=0)
    collect(engine, tokens)
    high = engine.scheduler.requests["high"]
    assert high.status == RequestStatus.RUNNING and high.num_computed_tokens == len(HIGH)  # it ran this step
    stats = engine.stats()
    assert stats.num_preemptions >= 1
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) >= 1
    while engine.has_unfinished_requests():
        collect(engine, tokens)
    assert tokens == reference(folder)
    assert engine.kv.usage() == 0.0
