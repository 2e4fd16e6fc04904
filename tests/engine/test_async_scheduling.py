"""Asynchronous scheduling in the scheduler alone (no model): ``advance`` / ``resolve`` driven as ``Engine.step``
drives them with one step in flight. The token still on the device is a count on the request
(``num_output_placeholders``), never an id in ``output_token_ids``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.engine import _params_counting_placeholders
from engine.inputs import build_step_inputs
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import Scheduler, SchedulerOutput
from tests.engine.test_scheduler import EOS, make_request, make_scheduler


def token_at(num_prompt: int, index: int) -> int:
    """A stand-in model: the ``index``-th output token depends only on the prompt length and the position, so
    the synchronous and asynchronous runs must sample the same tokens."""
    return 10 + (num_prompt * 3 + index * 7) % 13


def model_token(request: Request) -> int:
    return token_at(request.num_prompt_tokens, request.num_output_tokens)  # the count includes the in-flight one


@dataclass
class Launched:
    out: SchedulerOutput
    rows: list[Request]
    token_ids: list[int]  # what the device sampled, known to the host only at resolve


def launch(sched: Scheduler) -> Launched | None:
    """Schedule and "run" one step; like the engine, the inputs are built before ``advance``."""
    out = sched.schedule()
    if out.is_empty:
        return None
    inputs = build_step_inputs(out, sched.kv.block_size)
    assert inputs.num_tokens == out.num_tokens  # the in-flight token has a slot: no misaligned rows
    for chunk in out.chunks:
        request = chunk.request
        assert request.num_output_placeholders <= 1  # only the previous step is in flight while building
        if request.num_output_placeholders:
            # the chunk decodes exactly the in-flight token, the slot TokenFill writes on the device
            assert chunk.num_new_tokens == 1 and chunk.samples
    token_ids = [model_token(c.request) for c in out.chunks if c.samples]
    return Launched(out, sched.advance(out), token_ids)


def resolve(sched: Scheduler, step: Launched) -> list[Request]:
    return sched.resolve(step.out, step.rows, step.token_ids, [None] * len(step.token_ids))


def check_known_ids(sched: Scheduler) -> None:
    """After a resolve: the host-side lists hold real ids only, and every computed position has a known id
    (the prefix cache hashes ``all_token_ids`` up to ``num_computed_tokens``)."""
    for r in sched.requests.values():
        assert all(t >= 10 for t in r.output_token_ids)
        if r.status == RequestStatus.RUNNING:
            assert r.num_computed_tokens <= len(r.all_token_ids)


def run_async(sched: Scheduler, inflight: Launched | None = None) -> int:
    """``Engine.step`` with overlap: launch step N+1, then resolve step N. Returns the steps launched."""
    num_launched = 0
    while sched.num_unfinished or inflight is not None:
        launched = launch(sched)
        num_launched += launched is not None
        if inflight is not None:
            resolve(sched, inflight)
        inflight = launched
        check_known_ids(sched)
    return num_launched


def run_sync(sched: Scheduler) -> None:
    while sched.num_unfinished:
        step = launch(sched)
        assert step is not None
        resolve(sched, step)


def test_in_flight_token_is_a_count_not_an_id() -> None:
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=8)
    sched.add_request(r)
    first = launch(sched)
    assert first is not None
    assert r.num_output_placeholders == 1 and r.output_token_ids == []
    assert r.num_output_tokens == 1 and r.num_tokens == 6 and r.all_token_ids == r.prompt_token_ids
    second = launch(sched)  # scheduled while the first is in flight: decodes the unknown token
    assert second is not None
    assert [(c.request, c.num_new_tokens) for c in second.out.chunks] == [(r, 1)]
    assert r.num_output_placeholders == 2 and r.num_computed_tokens == 6
    assert resolve(sched, first) == [r]
    assert r.output_token_ids == first.token_ids and r.num_output_placeholders == 1
    assert resolve(sched, second) == [r]
    assert r.output_token_ids == first.token_ids + second.token_ids and r.num_output_placeholders == 0


def test_request_finished_while_a_step_is_in_flight_drops_its_placeholder() -> None:
    sched = make_scheduler()
    stops = make_request("stops", 4)
    aborted = make_request("aborted", 4, start=300)
    sched.add_request(stops)
    sched.add_request(aborted)
    first = launch(sched)
    second = launch(sched)
    assert first is not None and second is not None
    assert stops.num_output_placeholders == 2 and aborted.num_output_placeholders == 2
    sched.abort_group("aborted")
    assert aborted.num_output_placeholders == 0 and aborted.output_token_ids == [] and aborted.block_ids == []
    first.token_ids = [EOS if r is stops else t for r, t in zip(first.rows, first.token_ids, strict=True)]
    assert resolve(sched, first) == [stops]  # the aborted row is skipped
    assert stops.status == RequestStatus.FINISHED_STOPPED and stops.output_token_ids == [EOS]
    assert stops.num_output_placeholders == 0 and stops.block_ids == []  # second's token dropped with it
    assert resolve(sched, second) == []
    assert stops.output_token_ids == [EOS] and aborted.output_token_ids == []
    assert sched.kv.usage() == 0.0 and not sched.num_unfinished


def test_max_tokens_counts_the_in_flight_token() -> None:
    for max_tokens in (1, 2, 3):
        sched = make_scheduler()
        r = make_request("r", 4, max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(r)
        first = launch(sched)
        if max_tokens == 1:
            assert launch(sched) is None  # its only token is in flight: nothing left to schedule
        # one step per token: none is scheduled past the limit (its sample would be thrown away)
        assert 1 + run_async(sched, first) == max_tokens
        assert r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == max_tokens
        assert r.num_output_placeholders == 0


def test_max_model_len_counts_the_in_flight_token() -> None:
    sched = make_scheduler(max_model_len=7)
    r = make_request("r", 4, max_tokens=100, ignore_eos=True)
    sched.add_request(r)
    assert run_async(sched) == 3  # 4 prompt + 3 outputs; the 3rd is launched with 4 + 2 counted
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 7 and r.num_output_placeholders == 0


def test_preempting_a_request_with_a_token_in_flight() -> None:
    # 4 blocks of 4 tokens: two 7-token prompts fill them; the step that writes position 8 preempts b.
    sched = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    a = make_request("a", 7, start=10, max_tokens=6, ignore_eos=True)
    b = make_request("b", 7, start=50, max_tokens=6, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    first = launch(sched)  # both prefill
    second = launch(sched)  # both decode position 7 (its token still on the device)
    assert first is not None and second is not None
    resolve(sched, first)
    third = launch(sched)  # position 8 needs a third block each: b is preempted, its second token in flight
    assert third is not None and third.out.num_preempted == 1
    assert [c.request for c in third.out.chunks] == [a]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.num_output_placeholders == 1 and len(b.output_token_ids) == 1
    assert b in resolve(sched, second)  # the token still arrives, and is kept for the recompute
    assert b.num_output_placeholders == 0 and b.output_token_ids == [token_at(7, 0), token_at(7, 1)]
    # re-admitted with every id known: its recompute chunk reads no in-flight slot (checked in launch)
    run_async(sched, third)
    assert b.num_preemptions == 1
    sync = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    sync_a = make_request("a", 7, start=10, max_tokens=6, ignore_eos=True)
    sync_b = make_request("b", 7, start=50, max_tokens=6, ignore_eos=True)
    sync.add_request(sync_a)
    sync.add_request(sync_b)
    run_sync(sync)
    assert (a.output_token_ids, b.output_token_ids) == (sync_a.output_token_ids, sync_b.output_token_ids)
    assert len(a.output_token_ids) == 6 and sched.kv.usage() == 0.0


def test_async_matches_sync_with_stops_min_tokens_and_prefix_caching() -> None:
    def requests() -> list[Request]:
        return [
            make_request("plain", 9, start=10, max_tokens=7, ignore_eos=True),
            make_request("stop", 5, start=40, max_tokens=20, stop_token_ids=[token_at(5, 3)]),
            make_request("min", 5, start=70, max_tokens=20, stop_token_ids=[token_at(5, 3)], min_tokens=6),
            make_request("one", 6, start=90, max_tokens=1),
            make_request("again", 9, start=10, max_tokens=5, ignore_eos=True),  # plain's prompt and tokens
        ]

    results = []
    for run in (run_sync, run_async):
        sched = make_scheduler(block_size=4, max_num_batched_tokens=12)
        reqs = requests()
        for r in reqs:
            sched.add_request(r)
        run(sched)
        # every block registered from this run holds real ids: a lookup for the full sequence hits them
        probe = make_request("probe", 0)
        probe.prompt_token_ids = reqs[0].all_token_ids
        _, hit = sched.kv.get_computed_blocks(probe)
        results.append(([(r.output_token_ids, r.status) for r in reqs], hit, sched.kv.usage()))
    assert results[0] == results[1]
    outputs, hit, usage = results[0]
    assert hit == 12 and usage == 0.0  # 9 prompt + 6 computed outputs (the 7th never ran): 3 full blocks
    assert outputs[1][1] == RequestStatus.FINISHED_STOPPED and len(outputs[1][0]) == 4
    assert outputs[2][1] == RequestStatus.FINISHED_STOPPED and len(outputs[2][0]) > 6


def test_sampler_min_tokens_counts_the_in_flight_token() -> None:
    """The sampler masks stop ids by ``len(output_token_ids)``, which lacks the in-flight token: the engine's
    params for it must still block exactly the first min_tokens tokens."""
    logits = torch.zeros(1, 16)
    logits[0, EOS] = 5.0  # greedy picks EOS unless it is masked
    sampler = Sampler(torch.device("cpu"))
    for num_known, in_flight, masked in ((2, 1, True), (3, 1, False), (3, 0, True), (4, 0, False)):
        r = make_request("r", 3, min_tokens=4)
        r.output_token_ids = [11] * num_known
        r.num_output_placeholders = in_flight
        batch = SamplingBatch(
            [_params_counting_placeholders(r)], [r.prompt_token_ids], [r.output_token_ids], [None], [(EOS,)]
        )
        chosen = int(sampler.sample_ids(logits, batch)[0])
        assert (chosen != EOS) == masked, (num_known, in_flight)  # the token drawn is number num_tokens + 1
    assert r.sampling_params.min_tokens == 4  # the request's own params are never changed
