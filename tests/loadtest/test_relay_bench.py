"""``pagedserve bench relay --mode relay``, short and small: a publisher process writes one EventBatch per step
for every job and each reader must get every delta exactly once, in order, then the final event; a relay that
loses or repeats a delta makes the bench report it (so the check can fail)."""

from __future__ import annotations

from typing import Any

import pytest

import api.relay
from loadtest.relay_bench import ReaderStats, check_delivery, run_relay
from wire.messages import Event

JOBS = 4
DURATION_S = 1.0


@pytest.mark.parametrize(("own_channel", "merge"), [(False, True), (True, False)], ids=["reply-merge", "per-job"])
async def test_every_event_delivered_once_in_order(redis_url: str, own_channel: bool, merge: bool) -> None:
    res = await run_relay(redis_url, JOBS, 2, DURATION_S, own_channel, merge)
    assert res["num_problems"] == 0, res["problems"]
    assert res["channel"] == ("per-job" if own_channel else "reply")
    assert res["published"] == res["delivered"] > JOBS * 10  # many steps, every one delivered
    assert res["delivered_eps"] > 0 and res["consumer_cpu_pct"] > 0


def _drop_seq_3(events: list[Event]) -> list[Event]:
    return [ev for ev in events if ev.seq != 3]


def _repeat_seq_3(events: list[Event]) -> list[Event]:
    return events + [ev for ev in events if ev.seq == 3]


@pytest.mark.parametrize(
    ("fault", "problem"),
    [(_drop_seq_3, "delta 4 where 3 was next"), (_repeat_seq_3, "delta 3 where")],
    ids=["lost", "duplicated"],
)
async def test_a_lost_or_repeated_delta_is_reported(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, fault: Any, problem: str
) -> None:
    merge = api.relay.merge_deltas
    monkeypatch.setattr(api.relay, "merge_deltas", lambda events: merge(fault(events)))
    res = await run_relay(redis_url, 2, 1, DURATION_S, own_channel=False, merge=True)
    assert res["num_problems"] >= 2, res  # each job's stream
    assert any(problem in p for p in res["problems"]), res["problems"]  # merged with its neighbours or not


def test_check_delivery_wants_every_delta_and_the_final_event() -> None:
    done = ReaderStats(delivered=5, final_seq=5)
    assert check_delivery({"a": done}, {"a": 5}) == []
    assert check_delivery({"a": ReaderStats(delivered=5)}, {"a": 5})  # no final event
    assert check_delivery({"a": ReaderStats(delivered=4, final_seq=5)}, {"a": 5})  # one short
    assert check_delivery({"a": done}, {"a": 6})  # the publisher wrote more
