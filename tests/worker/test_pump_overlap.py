"""The front's pump builds the next step's events while the previous pipeline is in Redis, and a job's events
still land in order. A real ``GenerationWorker`` (tokenizer, jobs, events) against a real redis-server whose
writes are held back with ``CLIENT PAUSE``, fed step messages by the benchmark's stand-in core."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

import modelfiles
from engine.core_messages import CoreStats, SeqOutput, StepOutputs
from loadtest.pump_bench import StepFeed
from wire import keys
from wire.messages import DeltaEvent, Event, JobPayload, decode_event
from wire.sampling import SamplingSpec
from worker.pump_trace import ENV_VAR

JOBS = 2
TOKENS = [1000, 2000, 3000, 4000]


async def _wait(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _step(step: int) -> StepOutputs:
    outputs = [SeqOutput(f"j{i}", 0, [TOKENS[step] + i]) for i in range(JOBS)]
    return StepOutputs(outputs, CoreStats(), [], time.perf_counter())


async def _scenario(redis_url: str) -> tuple[list[int], list[list[Event]], list[list[int]]]:
    from transformers import AutoTokenizer

    from worker.front import GenerationWorker
    from worker.main import connect
    from worker.settings import WorkerSettings

    tokenizer = AutoTokenizer.from_pretrained(modelfiles.resolve(None).folder)
    redis = await connect(redis_url)
    admin = aioredis.from_url(redis_url)
    feed = StepFeed(len(tokenizer))
    settings = WorkerSettings(redis_url=redis_url, max_jobs=JOBS)
    worker = GenerationWorker(feed, settings, redis, "t", tokenizer, CollectorRegistry())  # type: ignore[arg-type]
    assert worker.pump_trace is not None
    records = worker.pump_trace.records
    pump = asyncio.ensure_future(worker.pump())
    now = time.time()
    spec = SamplingSpec(max_tokens=len(TOKENS) + 1, ignore_eos=True)
    jobs = []
    for i in range(JOBS):
        payload = JobPayload(f"j{i}", "t", [1, 2, 3], spec, now, now + 60, reply_channel="pagedserve:reply:t")
        jobs.append(asyncio.ensure_future(worker.generate({"job_try": 1}, payload.to_dict())))
    await _wait(lambda: len(feed.added) == JOBS)
    await feed.queue.put(_step(0))
    await _wait(lambda: len(records) == 1)
    await admin.execute_command("CLIENT", "PAUSE", 500, "WRITE")  # the next pipeline waits in Redis
    await feed.queue.put(_step(1))
    await asyncio.sleep(0.1)
    await feed.queue.put(_step(2))
    await _wait(feed.queue.empty, timeout_s=0.3)  # taken and built while pipeline 2 is still in Redis
    in_flight = len(records)
    await _wait(lambda: len(records) == 3)
    await feed.queue.put(_step(3))
    await _wait(lambda: len(records) == 4)
    events = []
    for i in range(JOBS):
        raw = await admin.lrange(keys.events_key(f"j{i}"), 0, -1)  # type: ignore[misc]
        events.append([decode_event(r) for r in raw])
    pump.cancel()
    for job in jobs:
        job.cancel()
    await asyncio.gather(pump, *jobs, return_exceptions=True)
    await redis.aclose()
    await admin.aclose()
    expected = [[TOKENS[s] + i for s in range(len(TOKENS))] for i in range(JOBS)]
    return [in_flight, len(records)], events, expected


def test_next_step_is_built_while_a_pipeline_is_in_redis_and_events_stay_in_order(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "pump.jsonl"))
    counts, events, expected = asyncio.run(_scenario(redis_url))
    assert counts == [1, 4]  # step 3 was taken while only pipeline 1 had returned
    for job_events, tokens in zip(events, expected, strict=True):
        assert [e.seq for e in job_events] == list(range(len(TOKENS)))
        deltas = [e for e in job_events if isinstance(e, DeltaEvent)]
        assert len(deltas) == len(job_events)
        assert [t for e in deltas for t in e.choices[0].token_ids] == tokens
