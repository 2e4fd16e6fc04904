"""``InputBatch`` (rows kept between steps) against ``build_step_inputs`` (rebuilt each step), side by side on
every step of randomized runs through a real ``Scheduler`` and KV cache manager: chunked prefill, prefix-cache
hits, n > 1 forks (copy-on-write), recompute and swap preemption, priorities, aborts, and asynchronous
scheduling (one step in flight, its tokens known only at resolve). No model, no torch beyond the tensors."""

from __future__ import annotations

import random
from dataclasses import fields

import numpy as np
import pytest
import torch

from cache.kv import KVCacheManager
from cache.swap import SwapKVCacheManager
from engine.config import SchedulerConfig
from engine.input_batch import InputBatch
from engine.inputs import StepInputs, build_step_inputs, fresh_suffix
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4


def assert_same_inputs(got: StepInputs, want: StepInputs) -> None:
    for f in fields(StepInputs):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f.name
            assert a.is_contiguous() and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        ([(0, 5), (0, 7)], (0, 0)),  # all fresh
        ([(9, 1), (3, 4), (0, 5), (0, 2)], (2, 5)),  # a decode row and a chunk after its prefix, then two prompts
        ([(0, 5), (9, 1), (0, 3)], (2, 6)),  # a fresh prompt before a decode row stays with the rest
        ([(0, 5), (0, 1)], None),  # a one-token prompt last
        ([(0, 5), (4, 4)], None),  # a prefix-cache hit last
        ([], None),
    ],
)
def test_fresh_suffix_is_the_last_run_of_fresh_prompts(
    rows: list[tuple[int, int]], want: tuple[int, int] | None
) -> None:
    """(first sequence, first token) of the step's trailing fresh prompts: rows are (cached, new) tokens."""
    qsl = np.concatenate([[0], np.cumsum([n for _, n in rows], dtype=np.int64)]).astype(np.int32)
    assert fresh_suffix(qsl, np.array([c + n for c, n in rows], dtype=np.int64)) == want


def add_group(sched: Scheduler, rng: random.Random, group_id: str, prefixes: list[list[int]]) -> None:
    """A caller request of 1-3 samples whose prompt often starts with a shared prefix (prefix-cache hits)."""
    prompt = list(rng.choice(prefixes)) if rng.random() < 0.5 else []
    prompt += [rng.randrange(3, 500) for _ in range(rng.randint(1, 14))]
    n = rng.choice([1, 1, 2, 3])
    params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), n=n)
    priority = rng.randint(0, 2)
    for i in range(n):
        rid = group_id if n == 1 else f"{group_id}#{i}"
        sched.add_request(
            Request(
                rid,
                prompt,
                params,
                eos_token_ids=(2,),
                priority=priority,
                group_id=group_id,
                sample_index=i,
                waiting_for_fork=i > 0,
            )
        )


def make_scheduler(seed: int, swap: bool, policy: str) -> Scheduler:
    rng = random.Random(seed)
    num_blocks = rng.randint(14, 40)  # tight: preemptions happen
    kv = SwapKVCacheManager(num_blocks, BLOCK_SIZE, 24) if swap else KVCacheManager(num_blocks, BLOCK_SIZE, True)
    config = SchedulerConfig(
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.randint(8, 24),
        policy=policy,
        preemption_mode="auto" if swap else "recompute",
    )
    return Scheduler(config, kv, max_model_len=64)


def run_side_by_side(seed: int, swap: bool, policy: str, overlap: bool) -> int:
    """Returns the number of steps compared."""
    rng = random.Random(seed)
    sched = make_scheduler(seed, swap, policy)
    batch = InputBatch(BLOCK_SIZE, max_num_reqs=2, max_blocks_per_req=2)  # small: rows and columns grow
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    inflight: tuple[SchedulerOutput, list[Request], list[int]] | None = None
    num_groups = num_steps = 0
    while num_groups < 30 or sched.num_unfinished or inflight is not None:
        if num_groups < 30 and rng.random() < 0.4:
            add_group(sched, rng, f"g{num_groups}", prefixes)
            num_groups += 1
        if rng.random() < 0.05 and sched.groups:
            sched.abort_group(rng.choice(list(sched.groups)))
        out = sched.schedule()
        launched = None
        if not out.is_empty:
            assert_same_inputs(batch.build(out), build_step_inputs(out, BLOCK_SIZE, batch.max_width))
            num_steps += 1
            rows = sched.advance(out)
            # a token id by a fixed rule, EOS now and then
            launched = (out, rows, [2 if rng.random() < 0.05 else 3 + len(r.output_token_ids) for r in rows])
        if overlap:
            if inflight is not None:
                sched.resolve(inflight[0], inflight[1], inflight[2], [None] * len(inflight[2]))
            inflight = launched
        elif launched is not None:
            sched.resolve(*launched, [None] * len(launched[2]))
        for group_id in [g for g, rs in sched.groups.items() if all(r.is_finished for r in rs)]:
            sched.release_group(group_id)
    assert all(r.status != RequestStatus.RUNNING for rs in sched.groups.values() for r in rs)
    return num_steps


@pytest.mark.parametrize(
    ("swap", "policy", "overlap"),
    [(False, "fcfs", False), (False, "priority", True), (True, "fcfs", True), (True, "priority", False)],
)
def test_input_batch_equals_the_rebuilt_inputs(swap: bool, policy: str, overlap: bool) -> None:
    num_steps = sum(run_side_by_side(seed, swap, policy, overlap) for seed in range(6))
    assert num_steps > 200


def test_rows_are_reused_once_requests_leave() -> None:
    sched = make_scheduler(0, swap=False, policy="fcfs")
    batch = InputBatch(BLOCK_SIZE, max_num_reqs=4)
    for i in range(12):
        sched.add_request(Request(f"r{i}", [5 + i] * 6, SamplingParams(temperature=0.0, max_tokens=3)))
    while sched.num_unfinished:
        out = sched.schedule()
        assert_same_inputs(batch.build(out), build_step_inputs(out, BLOCK_SIZE, batch.max_width))
        sched.update(out, {c.request.request_id: (7, None) for c in out.chunks if c.samples})
        assert batch.num_rows <= max(4, sched.config.max_num_seqs)


@pytest.mark.parametrize(
    ("q_lens", "want"),
    [([1, 1, 5, 1], 2), ([1, 1], 2), ([3, 1, 1], 0), ([], 0), ([1, 2], 1)],
)
def test_leading_decode_rows_counts_the_one_token_sequences_before_the_first_longer_one(
    q_lens: list[int], want: int
) -> None:
    from engine.inputs import leading_decode_rows

    assert leading_decode_rows(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)) == want


def test_table_width_is_aligned_unless_that_passes_the_cap() -> None:
    from engine.inputs import TABLE_WIDTH_ALIGN, table_width

    assert table_width(1) == TABLE_WIDTH_ALIGN
    assert table_width(TABLE_WIDTH_ALIGN + 1) == 2 * TABLE_WIDTH_ALIGN
    assert table_width(2 * TABLE_WIDTH_ALIGN) == 2 * TABLE_WIDTH_ALIGN
    assert table_width(20, cap=30) == 20  # 32 would pass the widest table a step may have
    assert table_width(20, cap=32) == 32
