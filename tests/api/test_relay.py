"""Events from Redis to SSE without an engine (a scripted worker answers the real queue): lost and duplicated
deltas, EventSource ids and resume from Last-Event-ID, the response cache with no worker at all."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import redis

from tests.api.conftest import MODEL, ScriptedWorker, ServerThread
from wire import keys

MSGS = [{"role": "user", "content": "hi"}]


def _client(api: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0)


async def test_lost_and_duplicated_deltas_are_recovered(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, pieces=["a", "b", "c", "d", "e"], unpublished={1, 3}, duplicated={0, 2})

    async def read() -> list[str]:
        stream = await _client(api).completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True)
        return [c.choices[0].text async for c in stream if c.choices]

    texts, _ = await asyncio.gather(read(), worker.serve())
    assert "".join(texts) == "abcde"  # in order, once each (deltas read back together may come merged)


async def test_stream_and_non_stream_chat(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url)
    client = _client(api)

    async def streamed() -> tuple[str, openai.types.CompletionUsage | None]:
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=MSGS, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        parts, usage = [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            parts += [c.delta.content or "" for c in chunk.choices]
        return "".join(parts), usage

    (text, usage), _ = await asyncio.gather(streamed(), worker.serve())
    plain, _ = await asyncio.gather(
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4),  # type: ignore[arg-type]
        worker.serve(),
    )
    assert text == plain.choices[0].message.content == "Hello, world!"
    assert usage is not None and plain.usage is not None
    assert usage.completion_tokens == plain.usage.completion_tokens == 4
    assert usage.prompt_tokens == plain.usage.prompt_tokens == len(worker.payloads[0].prompt_token_ids)
    assert worker.payloads[0].stream and not worker.payloads[1].stream


def _sse_events(lines: list[str]) -> list[tuple[str | None, str]]:
    events, ev_id, data = [], None, None
    for line in lines:
        if line.startswith("id:"):
            ev_id = line[3:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
        elif line == "" and data is not None:
            events.append((ev_id, data))
            ev_id, data = None, None
    return events


def _read_events(url: str, last_event_id: str | None = None, limit: int | None = None) -> list[tuple[str | None, str]]:
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    lines: list[str] = []
    with httpx.stream("GET", url, headers=headers, timeout=20) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            lines.append(line)
            if limit is not None and len(_sse_events(lines)) >= limit:
                break
    return _sse_events(lines)


def _text(events: list[tuple[str | None, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            out += [c.get("delta", {}).get("content") or c.get("text") or "" for c in json.loads(data)["choices"]]
    return "".join(out)


async def test_jobs_eventsource_ids_and_resume(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, pieces=["one ", "two ", "three ", "four"])
    resp = httpx.post(api.url + "/v1/jobs", json={"model": MODEL, "messages": MSGS, "max_tokens": 4}, timeout=10)
    assert resp.status_code == 202, resp.text
    job = resp.json()
    await worker.serve()
    url = api.url + job["events_url"]
    full = await asyncio.to_thread(_read_events, url)
    assert full[-1] == (None, "[DONE]")
    ids = [i for i, _ in full[:-1]]
    assert all(ids) and len(set(ids)) == len(ids)
    assert _text(full) == "one two three four"
    # a client that dropped after 3 events resumes with the id it saw last: the rest, exactly once
    head = full[:3]
    tail = await asyncio.to_thread(_read_events, url, head[-1][0])
    assert head + tail == full
    # resuming after the last event only closes the stream
    assert await asyncio.to_thread(_read_events, url, full[-2][0]) == [(None, "[DONE]")]
    status = httpx.get(api.url + f"/v1/jobs/{job['id']}", timeout=10).json()
    assert status["status"] == "completed"
    assert status["result"]["choices"][0]["message"]["content"] == "one two three four"


async def test_jobs_events_while_generating(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, pieces=["x"] * 20)
    job = httpx.post(api.url + "/v1/jobs", json={"model": MODEL, "prompt": "p", "max_tokens": 20}, timeout=10).json()
    reader = asyncio.create_task(asyncio.to_thread(_read_events, api.url + job["events_url"]))
    await asyncio.sleep(0.2)  # the reader subscribes before the first event exists
    await worker.serve()
    events = await reader
    assert _text(events) == "x" * 20 and events[-1][1] == "[DONE]"


@pytest.mark.parametrize("stream", [False, True])
async def test_cache_hit_needs_no_worker(api: ServerThread, redis_url: str, stream: bool) -> None:
    worker = ScriptedWorker(redis_url, pieces=["cached", " answer"])
    client = _client(api)
    kwargs = {"model": MODEL, "messages": MSGS, "max_tokens": 2, "temperature": 0.0}
    first, _ = await asyncio.gather(client.chat.completions.create(**kwargs), worker.serve())  # type: ignore[call-overload]
    assert first.choices[0].message.content == "cached answer"
    # no worker now: the queue must stay empty and the answer still come back, streamed or not
    sync = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=5)
    if stream:
        chunks = list(sync.chat.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
    else:
        hit = await client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        text = hit.choices[0].message.content
        assert hit.id != first.id and hit.usage.completion_tokens == 2
    assert text == "cached answer"
    assert redis.Redis.from_url(redis_url).zcard(keys.QUEUE) == 0
    metrics = httpx.get(api.url + "/metrics", timeout=5).text
    assert "pagedserve:response_cache_hits_total" in metrics


async def streamed_text(client: openai.AsyncOpenAI, kwargs: dict[str, object]) -> str:
    stream = await client.chat.completions.create(**kwargs, stream=True)  # type: ignore[call-overload]
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


@pytest.mark.parametrize("rest_in_final", [False, True], ids=["deltas-only", "rest-in-final"])
async def test_a_streamed_jobs_answer_is_assembled_from_its_deltas(
    api: ServerThread, redis_url: str, rest_in_final: bool
) -> None:
    """The worker's final for a streamed job carries only what its deltas did not (FinalEvent.streamed): the
    stream, the usage, the job's status and the cached answer are still the whole answer, for n = 2 too."""
    worker = ScriptedWorker(redis_url, pieces=["str", "eamed", " whole"], rest_in_final=rest_in_final)
    client = _client(api)
    kwargs = {"model": MODEL, "messages": MSGS, "max_tokens": 3, "temperature": 0.0, "n": 2}

    async def streamed() -> tuple[dict[int, str], openai.types.CompletionUsage | None]:
        stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
        texts: dict[int, str] = {0: "", 1: ""}
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        return texts, usage

    (texts, usage), _ = await asyncio.gather(streamed(), worker.serve())
    assert texts == {0: "streamed whole", 1: "streamed whole"}
    assert usage is not None and usage.completion_tokens == 6
    raw = redis.Redis.from_url(redis_url).lrange(keys.events_key(worker.payloads[0].request_id), -1, -1)[0]
    final = json.loads(raw)
    assert final["kind"] == "final" and final["streamed"] is True
    assert [c["text"] for c in final["result"]["choices"]] == [" whole" if rest_in_final else ""] * 2
    # the answer a streamed job leaves in the response cache (n = 1) is the whole one: served with no worker
    one = {**kwargs, "n": 1}
    first, _ = await asyncio.gather(streamed_text(client, one), worker.serve())
    assert first == "streamed whole"
    hit = await client.chat.completions.create(**one)  # type: ignore[call-overload]
    assert hit.choices[0].message.content == "streamed whole" and hit.usage.completion_tokens == 3
    assert redis.Redis.from_url(redis_url).zcard(keys.QUEUE) == 0
    job = httpx.post(api.url + "/v1/jobs", json={**kwargs, "temperature": 0.5, "seed": 3}, timeout=10).json()
    await worker.serve()  # /v1/jobs streams its events: a streamed final there too
    status = httpx.get(api.url + f"/v1/jobs/{job['id']}", timeout=10).json()
    assert [c["message"]["content"] for c in status["result"]["choices"]] == ["streamed whole"] * 2
    assert status["result"]["usage"]["completion_tokens"] == 6


async def test_unseeded_sampling_is_not_cached(api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url)
    client = _client(api)
    kwargs = {"model": MODEL, "prompt": "p", "max_tokens": 4, "temperature": 0.8}
    await asyncio.gather(client.completions.create(**kwargs), worker.serve())  # type: ignore[call-overload]
    await asyncio.gather(client.completions.create(**kwargs), worker.serve())  # type: ignore[call-overload]
    assert len(worker.payloads) == 2


async def test_a_token_whose_text_is_held_back_still_gets_its_chunk(api: ServerThread, redis_url: str) -> None:
    """As vLLM streams it: a step whose token adds no text yet (the first bytes of a character) is a chunk with
    "" text, so a client sees one chunk per token, and the text is unchanged."""
    # deltas a step apart: written back to back, the relay would rightly merge the ones a late reader finds waiting
    worker = ScriptedWorker(redis_url, pieces=["Hel", "", "lo"], step_s=0.1)

    async def texts() -> list[str]:
        stream = await _client(api).completions.create(model=MODEL, prompt="p", max_tokens=3, stream=True)
        return [
            c.choices[0].text for c in [chunk async for chunk in stream] if c.choices and not c.choices[0].finish_reason
        ]

    got, _ = await asyncio.gather(texts(), worker.serve())
    assert got == ["Hel", "", "lo"]
