"""A job's pending deltas (no Redis, no model): --stream-interval, resuming after a lost worker, merging."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from api.relay import merge_deltas
from engine.output_processor import ChoiceUpdate
from engine.request import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from wire.messages import ChoiceDelta, DeltaEvent, FinalEvent, JobPayload, assemble
from wire.sampling import SamplingSpec
from worker.failover import PriorAttempt
from worker.jobs import ActiveJob


def _job(prior: PriorAttempt | None = None) -> ActiveJob:
    payload = JobPayload("j", "m", [1, 2], SamplingSpec(max_tokens=10), time.time(), time.time() + 60)
    prior = prior or PriorAttempt()
    loop = asyncio.new_event_loop()
    try:
        return ActiveJob(
            payload, SamplingParams(max_tokens=10), prior.num_events, prior, time.time(), loop.create_future()
        )
    finally:
        loop.close()


def _update(text: str, token_ids: list[int], finish: str | None = None) -> ChoiceUpdate:
    return ChoiceUpdate("j", 0, text, token_ids, None, finish)


def test_stream_interval_sends_the_first_token_at_once_then_every_n() -> None:
    job = _job()
    sent: list[str] = []
    for k in range(8):
        job.take(_update(f"t{k}", [k]))
        job.finished = k == 7
        if job.should_flush(3):
            event = job.delta()
            assert event is not None
            job.last_event_at = time.time()
            sent.append("".join(c.text for c in event.choices))
    assert sent == ["t0", "t1t2t3", "t4t5t6", "t7"]
    assert job.next_seq == 4


def test_a_rerun_skips_what_the_client_already_has() -> None:
    prior = PriorAttempt(num_events=2, tokens={0: [5, 6, 7]}, chars={0: 5})  # "Hel" + "lo" were sent
    job = _job(prior)
    job.take(_update("He", [5, 6]))
    assert job.delta() is None  # all of it was sent before
    job.take(_update("llo!", [7, 8]))
    event = job.delta()
    assert event is not None and event.seq == 2
    assert [(c.text, c.token_ids) for c in event.choices] == [("!", [8])]


def test_merged_deltas_keep_every_piece_once_in_order() -> None:
    events = [
        DeltaEvent(0, [ChoiceDelta(0, "a", [1]), ChoiceDelta(1, "x", [9])]),
        DeltaEvent(1, [ChoiceDelta(0, "b", [2])]),
        DeltaEvent(2, [ChoiceDelta(1, "y", [8]), ChoiceDelta(0, "c", [3])]),
    ]
    (merged,) = merge_deltas(events)  # type: ignore[arg-type]
    assert isinstance(merged, DeltaEvent) and merged.seq == 2
    assert {c.index: (c.text, c.token_ids) for c in merged.choices} == {0: ("abc", [1, 2, 3]), 1: ("xy", [9, 8])}
    final = FinalEvent(3, None)  # type: ignore[arg-type]
    assert merge_deltas([*events[:1], final])[1] is final  # a final event is never folded in


def _output(text: str, token_ids: list[int]) -> RequestOutput:
    return RequestOutput("j", None, [1, 2], [CompletionOutput(0, text, token_ids, None, None, "stop")], True)


def test_a_streamed_jobs_final_holds_only_what_its_deltas_did_not() -> None:
    job = _job()
    job.take(_update("Hel", [5]))
    job.take(_update("lo", [6], "stop"))
    job.finished = True
    assert job.delta() is not None  # the flush before the final
    whole = _output("Hello!", [5, 6, 7])  # the processor's text runs past the updates: the rest goes in the final
    result = job.result(whole, time.time())
    assert [(c.text, c.token_ids, c.finish_reason) for c in result.choices] == [("!", [7], "stop")]
    assert result.completion_tokens == 3  # the usage counts every token
    final = FinalEvent(1, result, streamed=True)
    deltas = [DeltaEvent(0, [ChoiceDelta(0, "Hello", [5, 6])])]
    assert [(c.text, c.token_ids) for c in assemble(final, deltas).choices] == [("Hello!", [5, 6, 7])]


def test_a_rerun_counts_what_the_earlier_attempt_sent_and_a_non_streamed_final_is_whole() -> None:
    prior = PriorAttempt(num_events=2, tokens={0: [5, 6]}, chars={0: 5})
    job = _job(prior)
    job.take(_update("He", [5]))  # the rerun has not caught up with what was sent
    assert [c.text for c in job.result(_output("Hello", [5, 6]), time.time()).choices] == [""]
    job.payload = dataclasses.replace(job.payload, stream=False)
    result = job.result(_output("Hello", [5, 6]), time.time())
    assert [(c.text, c.token_ids) for c in result.choices] == [("Hello", [5, 6])]
    final = FinalEvent(0, result)
    assert assemble(final, [DeltaEvent(0, [ChoiceDelta(0, "ignored", [1])])]) is result
