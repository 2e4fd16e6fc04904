"""Batched prompts and echo on /v1/completions (a scripted worker answers the real queue): choices numbered
prompt-major, usage added up, one usage chunk, the first error ends the request and aborts the rest."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import redis
import redis.asyncio as aioredis

from tests.api.conftest import MODEL, ScriptedWorker, ServerThread
from wire import keys
from wire.publisher import JobEventWriter

PROMPTS = [[11], [11, 12], [11, 12, 13]]  # told apart by length: the worker answers "<length>"


def _client(api: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)


async def _answer_by_length(worker: ScriptedWorker, count: int) -> None:
    for _ in range(count):
        payload = await worker.take()
        worker.pieces = [f"<{len(payload.prompt_token_ids)}", ">"]
        await worker.answer(payload)


async def test_batched_prompts_non_streaming(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url)
    create = _client(api).completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=2)
    resp, _ = await asyncio.gather(create, _answer_by_length(worker, 3))
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == ["<1>", "<1>", "<2>", "<2>", "<3>", "<3>"]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == 1 + 2 + 3 and resp.usage.completion_tokens == 3 * 2 * 2
    assert len({p.request_id for p in worker.payloads}) == 3 and resp.id.startswith("cmpl-")


async def test_batched_prompts_streaming(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url)

    async def read() -> list[openai.types.Completion]:
        stream = await _client(api).completions.create(
            model=MODEL, prompt=PROMPTS, n=2, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        return [c async for c in stream]

    chunks, _ = await asyncio.gather(read(), _answer_by_length(worker, 3))
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        assert len({chunk.id for chunk in chunks}) == 1
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == {i: f"<{i // 2 + 1}>" for i in range(6)} and finished == set(range(6))
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and chunks[-1].usage is not None and not chunks[-1].choices
    assert usages[0].prompt_tokens == 6 and usages[0].completion_tokens == 12


async def test_echo(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url)
    client = _client(api)
    resp, _ = await asyncio.gather(
        client.completions.create(model=MODEL, prompt="Say:", echo=True, max_tokens=4), worker.serve()
    )
    assert resp.choices[0].text == "Say:Hello, world!"

    async def streamed() -> str:
        stream = await client.completions.create(model=MODEL, prompt=["A:", "B:"], echo=True, max_tokens=4, stream=True)
        parts: dict[int, str] = {}
        async for chunk in stream:
            for c in chunk.choices:
                parts[c.index] = parts.get(c.index, "") + c.text
        return "|".join(parts[i] for i in sorted(parts))

    text, _ = await asyncio.gather(streamed(), worker.serve(2))
    assert text == "A:Hello, world!|B:Hello, world!"


async def test_one_failing_prompt_fails_the_batch_and_aborts_the_rest(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url)

    async def fail_first() -> list[str]:
        payload = await worker.take()
        client = aioredis.Redis.from_url(redis_url)
        await JobEventWriter(client, payload.request_id, 60).error("boom", "server_error", "engine_error", 500)
        await client.aclose()
        reader = aioredis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 10  # the API aborts the others in the background (slow on a loaded VM)
        while await reader.zcard(keys.ARQ_ABORT_SET) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = [m.decode() for m in await reader.zrange(keys.ARQ_ABORT_SET, 0, -1)]
        await reader.aclose()
        return aborted

    create = _client(api).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2)
    results = await asyncio.gather(create, fail_first(), return_exceptions=True)
    assert isinstance(results[0], openai.InternalServerError) and "boom" in str(results[0])
    queued = {m.decode() for m in redis.Redis.from_url(redis_url).zrange(keys.QUEUE, 0, -1)}
    assert len(queued) == 2 and set(results[1]) == queued  # type: ignore[arg-type]


def test_batch_validation(api: ServerThread, redis_url: str) -> None:
    def post(body: dict, path: str = "/v1/completions") -> httpx.Response:  # type: ignore[type-arg]
        return httpx.post(api.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=10)

    assert post({"prompt": ["x"] * 65}).status_code == 400
    assert post({"prompt": "x", "echo": True, "logprobs": 1}).json()["error"]["param"] == "echo"
    assert post({"prompt": ["a", "b"]}, "/v1/jobs").status_code == 400
    too_long = post({"prompt": [[5], list(range(5, 9000))]})  # the second prompt is over the context
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    assert redis.Redis.from_url(api.settings.redis_url).zcard(keys.QUEUE) == 0  # nothing was queued
