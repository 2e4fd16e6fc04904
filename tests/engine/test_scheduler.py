"""Scheduler unit tests: no model, no torch tensors, milliseconds."""

from __future__ import annotations

from cache.kv import KVCacheManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    policy: str = "fcfs",
    max_model_len: int = 1024,
    prefix_caching: bool = True,
    chunked: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching), max_model_len)


def make_request(rid: str, num_prompt: int, start: int = 100, priority: int = 0, **params: object) -> Request:
    sp = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **params})  # type: ignore[arg-type]
    return Request(rid, list(range(start, start + num_prompt)), sp, eos_token_ids=(EOS,), priority=priority)


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {c.request.request_id: (token, None) for c in out.chunks if c.samples}
    sched.update(out, sampled)
    return out


def test_one_token_budget_chunks_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 10, start=100 * (i + 1)))
    out = sched.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("r0", 10), ("r1", 6)]
    assert [c.samples for c in out.chunks] == [True, False]
    sched.update(out, {"r0": (7, None)})
    out = sched.schedule()
    # running first: r0 decodes one token, r1 finishes its prompt, r2 starts with what is left
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("r0", 1), ("r1", 4), ("r2", 10)]
    assert out.num_tokens <= 16


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, chunked=False)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10, start=300))
    out = sched.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 10)]
    assert sched.waiting[0].num_computed_tokens == 0


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 3, start=10 * i + 10))
    out = sched.schedule()
    assert len(out.chunks) == 2 and len(sched.running) == 2 and len(sched.waiting) == 2


def test_preemption_by_recompute_keeps_generated_tokens() -> None:
    # 4 blocks of 4 tokens: two 7-token prompts fill 4 blocks once they grow past 8 tokens.
    sched = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    sched.add_request(make_request("a", 7, start=10, max_tokens=6))
    sched.add_request(make_request("b", 7, start=50, max_tokens=6))
    run_step(sched)  # both prefill: 2 blocks each, 1 token out each
    run_step(sched)  # 8 tokens each: still fits in 2 blocks
    out = run_step(sched)  # both need a third block: the newest (b) is preempted
    assert out.num_preempted == 1
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.output_token_ids == [7, 7]  # kept: it recomputes prompt + outputs later
    assert sched.waiting[0] is b
    while sched.num_unfinished:
        run_step(sched)
    assert sched.requests["a"].num_output_tokens == 6 and b.num_output_tokens == 6
    assert sched.num_preemptions >= 1
    assert sched.kv.usage() == 0.0


def test_priority_policy_runs_lowest_value_first_and_preempts_highest() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add_request(make_request("low", 3, start=10, priority=5))
    sched.add_request(make_request("high", 3, start=20, priority=0))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["high"]


def test_stop_rules() -> None:
    sched = make_scheduler()
    eos = make_request("eos", 3)
    ignore = make_request("ignore", 3, start=200, ignore_eos=True, max_tokens=2)
    stop_id = make_request("stopid", 3, start=300, stop_token_ids=[9])
    min_tok = make_request("min", 3, start=400, min_tokens=2)
    for r in (eos, ignore, stop_id, min_tok):
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, {"eos": (EOS, None), "ignore": (EOS, None), "stopid": (9, None), "min": (EOS, None)})
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.block_ids == []
    assert ignore.status == RequestStatus.RUNNING
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 9
    assert min_tok.status == RequestStatus.RUNNING  # EOS before min_tokens does not stop
    out = sched.schedule()
    sched.update(out, {"ignore": (EOS, None), "min": (EOS, None)})
    assert ignore.status == RequestStatus.FINISHED_LENGTH  # max_tokens=2
    assert min_tok.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_finishes_with_length() -> None:
    sched = make_scheduler(max_model_len=5)
    r = make_request("r", 3, max_tokens=100)
    sched.add_request(r)
    while sched.num_unfinished:
        run_step(sched)
    assert r.num_tokens == 5 and r.status == RequestStatus.FINISHED_LENGTH


def test_prefix_cache_hit_computes_only_new_tokens() -> None:
    sched = make_scheduler(block_size=4)
    first = make_request("first", 10, start=500, max_tokens=1)
    sched.add_request(first)
    run_step(sched)
    assert first.is_finished
    second = Request("second", list(range(500, 508)) + [1, 2, 3], SamplingParams(max_tokens=1), eos_token_ids=(EOS,))
    sched.add_request(second)
    out = sched.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("second", 3)]
    assert second.num_computed_tokens == 8


def test_fork_shares_prompt_blocks_and_copies_partial_block() -> None:
    sched = make_scheduler(block_size=4)
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1)
    group = [
        Request(f"g#{i}", list(range(10, 16)), params, group_id="g", sample_index=i, waiting_for_fork=i > 0)
        for i in range(3)
    ]
    for r in group:
        sched.add_request(r)
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["g#0"]
    sched.update(out, {"g#0": (7, None)})
    # siblings now share both prompt blocks (one full, one partial)
    for sibling in group[1:]:
        assert sibling.block_ids == group[0].block_ids
        assert sibling.num_computed_tokens == 5
    assert [sched.kv.ref_count(b) for b in group[0].block_ids] == [3, 3]
    out = sched.schedule()
    ids = {c.request.request_id: c.num_new_tokens for c in out.chunks}
    assert ids == {"g#0": 1, "g#1": 1, "g#2": 1}
    # the full first block stays shared; the partial second block was copied for all but its last holder
    assert sched.kv.ref_count(group[0].block_ids[0]) == 3
    assert len({r.block_ids[1] for r in group}) == 3
    assert len(out.blocks_to_copy) == 2


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler()
    r = make_request("r", 9)
    sched.add_request(r)
    run_step(sched)
    assert sched.kv.usage() > 0
    sched.abort_group("r")
    assert r.status == RequestStatus.FINISHED_ABORTED and sched.kv.usage() == 0.0 and not sched.running
