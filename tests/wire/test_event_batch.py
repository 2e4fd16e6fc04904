"""EventBatch against a real Redis: every event lands in its job's list in order (the script cuts the one
argument that carries them all by length), the final event is also the job's result, and each channel gets one
message with its jobs' events, for text of any script."""

from __future__ import annotations

import json

import redis

from wire import keys
from wire.messages import ChoiceDelta, ChoiceResult, DeltaEvent, ErrorEvent, FinalEvent, JobResult, decode_event
from wire.publisher import EventBatch, decode_batch

TEXTS = ["Hello", " wörld", " 你好", " 🎉", '\n\t"quoted" \\ back', "", " end"]


async def test_one_batch_of_many_jobs_lands_whole_and_in_order(redis_url: str) -> None:
    sync = redis.Redis.from_url(redis_url)
    pubsub = sync.pubsub()
    pubsub.subscribe("chan:a", "chan:b")
    for _ in range(2):
        pubsub.get_message(timeout=1)  # the subscribe confirmations
    batch = EventBatch()
    sent: dict[str, list[str]] = {}
    for j in range(6):
        job = f"job-{j}"
        channel = "chan:a" if j % 2 else "chan:b"
        for seq, text in enumerate(TEXTS):
            event = DeltaEvent(seq, [ChoiceDelta(0, text, [seq, j])])
            batch.add(job, event, 60, channel)
        final = FinalEvent(len(TEXTS), JobResult(job, "m", [ChoiceResult(0, "".join(TEXTS), [1], "stop")], 3, 1))
        batch.add(job, final, 60, channel)
        sent[job] = [*TEXTS, "final"]
    batch.add("job-err", ErrorEvent(0, "nö", code="x"), 60, None)  # stored, not published
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    await batch.execute(client)
    await client.aclose()
    for j in range(6):
        stored = [decode_event(raw) for raw in sync.lrange(keys.events_key(f"job-{j}"), 0, -1)]
        assert [e.choices[0].text for e in stored if isinstance(e, DeltaEvent)] == TEXTS
        assert [e.seq for e in stored] == list(range(len(TEXTS) + 1)) and isinstance(stored[-1], FinalEvent)
        result = decode_event(sync.lindex(keys.events_key(f"job-{j}"), -1))  # the answer: the list's last event
        assert isinstance(result, FinalEvent) and result.result.choices[0].text == "".join(TEXTS)
        assert not sync.exists(f"pagedserve:result:job-{j}")  # no second copy of it
        assert 0 < sync.ttl(keys.events_key(f"job-{j}")) <= 60
    error = decode_event(sync.lrange(keys.events_key("job-err"), 0, -1)[0])
    assert isinstance(error, ErrorEvent) and error.message == "nö"
    messages = [pubsub.get_message(timeout=2) for _ in range(2)]
    by_channel = {m["channel"].decode(): decode_batch(m["data"]) for m in messages if m}
    assert {c: sorted({job for job, _ in pairs}) for c, pairs in by_channel.items()} == {
        "chan:a": ["job-1", "job-3", "job-5"],
        "chan:b": ["job-0", "job-2", "job-4"],
    }
    assert all(len(pairs) == 3 * (len(TEXTS) + 1) for pairs in by_channel.values())
    assert json.loads(messages[0]["data"])  # one JSON array per channel
    pubsub.close()
