"""End to end on the CPU engine with the default model: real Redis, two real worker processes on one queue,
real uvicorn, the real openai client. Workers start once for the module (model load is the slow part)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

import modelfiles
from api.app import connect_redis
from api.tokenizer import PromptTokenizer
from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ServerThread, start_api
from wire import keys
from wire.messages import ErrorEvent, JobPayload, WorkerHeartbeat, decode_event
from wire.sampling import SamplingSpec

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
WORKER_IDS = ("e2e-a", "e2e-b")
MSGS = [{"role": "user", "content": "Name three colors."}]


def _beats(url: str) -> dict[str, WorkerHeartbeat]:
    r = redis.Redis.from_url(url)
    raws: dict[str, bytes | None] = {w: r.get(keys.worker_key(w)) for w in WORKER_IDS}  # type: ignore[misc]
    return {w: WorkerHeartbeat.from_json(raw) for w, raw in raws.items() if raw}


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer) -> Iterator[tuple[ServerThread, list[subprocess.Popen[bytes]]]]:
    redis.Redis.from_url(redis_server.url).flushall()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deploy.cli",
                "worker",
                "--redis-url",
                redis_server.url,
                "--device",
                "cpu",
                "--max-num-seqs",
                "48",
                "--worker-id",
                wid,
                "--drain-timeout-s",
                "60",
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=ROOT,
        )
        for wid in WORKER_IDS
    ]
    api = start_api(redis_server, response_cache=False)
    try:
        deadline = time.monotonic() + 180
        while httpx.get(api.url + "/ready").json().get("workers") != len(WORKER_IDS):
            assert all(w.poll() is None for w in workers), "a worker died at start"
            assert time.monotonic() < deadline, "workers did not become ready"
            time.sleep(0.3)
        yield api, workers
    finally:
        api.stop()
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()


def test_seeded_stream_equals_non_stream_sync(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, _ = stack
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kwargs = {"model": MODEL, "messages": MSGS, "max_tokens": 12, "temperature": 0.9, "seed": 1234}
    harmless = {"response_format": {"type": "text"}, "tool_choice": "none"}  # the defaults, spelled out: accepted
    whole = client.chat.completions.create(**kwargs, **harmless)  # type: ignore[call-overload]
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    # the second request may hit the prefix cache the first one filled: all but cached_tokens must agree
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    cached = [u.prompt_tokens_details.cached_tokens for u in (usage, whole.usage) if u.prompt_tokens_details]
    assert all(0 <= c <= usage.prompt_tokens for c in cached)
    tok = PromptTokenizer(modelfiles.resolve(None).folder)
    assert usage.prompt_tokens == len(tok.encode_chat(MSGS))
    assert usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop"


async def test_seeded_stream_equals_non_stream_async(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, _ = stack
    client = openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "seed": 7}
    whole = await client.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = await client.completions.create(**kwargs, stream=True)  # type: ignore[call-overload]
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == whole.choices[0].text
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"


async def test_n_samples_stream_and_not(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, _ = stack
    client = openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kwargs = {"model": MODEL, "messages": MSGS, "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2}
    whole = await client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert sorted(c.index for c in whole.choices) == [0, 1]
    stream = await client.chat.completions.create(**kwargs, stream=True)  # type: ignore[call-overload]
    texts: dict[int, str] = {0: "", 1: ""}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_logit_bias_forces_a_token(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, _ = stack
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=60)
    (blue,) = PromptTokenizer(modelfiles.resolve(None).folder).encode(" blue")
    r = client.completions.create(
        model=MODEL, prompt="Sky:", max_tokens=3, temperature=0.0, logit_bias={str(blue): 100}
    )
    assert r.choices[0].text == " blue" * 3


def test_stop_sequence_is_honoured(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, _ = stack
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kwargs = {"model": MODEL, "prompt": "The colors of the rainbow are red,", "max_tokens": 12, "temperature": 0.0}
    free = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    cut = client.completions.create(**kwargs, stop=[stop])  # type: ignore[call-overload]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]


async def test_64_concurrent_streams_complete_in_order(
    stack: tuple[ServerThread, list[subprocess.Popen[bytes]]],
) -> None:
    api, _ = stack
    done_before = {w: b.jobs_done for w, b in _beats(api.settings.redis_url).items()}
    client = openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, str, int, str | None]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Count from {i}:",
            max_tokens=6,
            temperature=0.0,
            logprobs=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, tokens, usage, finish = [], [], 0, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                text.append(c.text)
                tokens += c.logprobs.tokens if c.logprobs and c.logprobs.tokens else []
                finish = c.finish_reason or finish
        return "".join(text), "".join(tokens), len(tokens) - usage, finish

    results = await asyncio.gather(*(one(i) for i in range(64)))
    for text, token_text, extra_tokens, finish in results:
        assert finish in ("length", "stop")
        assert extra_tokens == 0  # one logprob entry per generated token: nothing missing, nothing twice
        assert token_text == text
    whole = await client.completions.create(model=MODEL, prompt="Count from 5:", max_tokens=6, temperature=0.0)
    assert whole.choices[0].text == results[5][0]
    deadline = time.monotonic() + 10  # until the next heartbeats (every second) count the jobs
    while True:
        done_after = {w: b.jobs_done for w, b in _beats(api.settings.redis_url).items()}
        if all(done_after.get(w, 0) > done_before.get(w, 0) for w in WORKER_IDS):
            break
        assert time.monotonic() < deadline, (done_before, done_after)
        await asyncio.sleep(0.1)


def test_killed_client_job_is_aborted(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, _ = stack
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    with httpx.stream("POST", api.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        job_id = first.split('"id":"')[1].split('"')[0]
        next(lines)
        assert sum(b.num_running for b in _beats(api.settings.redis_url).values()) >= 0
    # the connection is closed: the worker must abort the request and free its KV blocks
    r = redis.Redis.from_url(api.settings.redis_url)
    deadline = time.monotonic() + 15
    while True:
        events = [decode_event(e) for e in r.lrange(keys.events_key(job_id), 0, -1)]  # type: ignore[union-attr]
        beats = _beats(api.settings.redis_url).values()
        idle = all(b.num_running == 0 and b.kv_cache_usage == 0.0 and b.active_jobs == 0 for b in beats)
        if events and events[-1].kind != "delta" and idle:
            break
        assert time.monotonic() < deadline, f"not aborted: {events[-1:]} {list(beats)}"
        time.sleep(0.2)
    last = events[-1]
    assert isinstance(last, ErrorEvent) and last.code == "aborted"
    assert len(events) < 400  # stopped early, not generated to the end


async def test_job_past_queue_deadline_is_dropped(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, _ = stack
    pool = await connect_redis(api.settings.redis_url)
    now = time.time()
    params = SamplingSpec(max_tokens=4, temperature=0.0)
    payload = JobPayload("late-job", MODEL, [1, 2, 3], params, now - 10, now - 5)
    await pool.enqueue_job(keys.JOB_FUNCTION, payload.to_dict(), _job_id=payload.request_id, _queue_name=keys.QUEUE)
    deadline = time.monotonic() + 10
    while not (raw := await pool.lrange(keys.events_key("late-job"), 0, -1)):  # type: ignore[misc]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    await pool.aclose()
    event = decode_event(raw[-1])
    assert isinstance(event, ErrorEvent) and event.code == "queue_deadline_exceeded" and len(raw) == 1


def test_sigterm_finishes_running_jobs_then_exits(stack: tuple[ServerThread, list[subprocess.Popen[bytes]]]) -> None:
    api, workers = stack  # last test of the module: it stops the workers
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=40, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    for w in workers:
        w.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].text for c in [first, *rest])) > 0
    for w in workers:
        assert w.wait(30) == 0
    assert httpx.get(api.url + "/ready").status_code == 503
