"""What a lost worker left behind, read back from a real Redis: tokens per choice, finished or not, divergence."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from wire.messages import ChoiceDelta, ChoiceResult, JobResult
from wire.publisher import JobEventWriter
from worker.failover import DivergedError, PriorAttempt


async def test_prior_attempt_collects_what_was_sent(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    writer = JobEventWriter(client, "job", 60)
    await writer.delta([ChoiceDelta(0, "Hel", [5, 6]), ChoiceDelta(1, "A", [9])])
    await writer.delta([ChoiceDelta(0, "lo", [7])])
    prior = await PriorAttempt.load(client, "job")
    assert prior.num_events == 2 and not prior.finished and prior.sent_anything
    assert prior.tokens == {0: [5, 6, 7], 1: [9]}
    assert prior.sent() == {0: (5, 3), 1: (1, 1)}
    prior.check(0, 0, [5, 6], False)  # a rerun still behind: fine
    prior.check(0, 2, [7, 8], False)  # caught up and beyond: fine
    prior.check(1, 0, [9, 3], False)
    prior.check(0, 3, [8], True)  # past what was sent: anything goes
    with pytest.raises(DivergedError):
        prior.check(0, 0, [5, 4], False)
    with pytest.raises(DivergedError):
        prior.check(0, 1, [6, 9], False)  # differs in a later step's tokens
    with pytest.raises(DivergedError):
        prior.check(0, 0, [5, 6], True)  # ended before reaching what was already sent

    await writer.final(JobResult("job", "m", [ChoiceResult(0, "Hello", [5, 6, 7], "length")], 1, 3))
    assert (await PriorAttempt.load(client, "job")).finished
    empty = await PriorAttempt.load(client, "other")
    assert empty.num_events == 0 and not empty.sent_anything and empty.sent() == {}
    await client.aclose()
