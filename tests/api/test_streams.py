"""OpenAI streams as written by ``api.streams.openai_stream``: delta chunks come from a per-stream JSON template
and a step's chunks go out in one write, so the bytes are checked against the formatter's chunk bodies
(``delta_chunks``/``final_chunks``, compact JSON, one ``data:`` event each): the same text byte for byte, for
multi-token deltas, n > 1, logprobs and the usage chunk, through the real app, the real relay and the real
tokenizer, with a worker that writes each step only after the client read the previous one (so the relay
merges nothing and the expected chunks are known)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

import modelfiles
from api.formatting import ResponseFormatter, dumps_chunk
from api.protocol import Kind
from api.tokenizer import PromptTokenizer
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread
from wire.messages import ChoiceDelta, ChoiceResult, DeltaEvent, FinalEvent, JobResult, TokenLogprob
from wire.publisher import JobEventWriter

N = 2
# a step's text per choice: several tokens each, quotes, a backslash, a newline, non-ASCII and an emoji
STEPS = [["He", 'y "'], ["llo\\", "yö\n"], [", wörld", " 🙂"]]
TAIL = "!"  # in the final result only: sent with the finish reason


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(modelfiles.resolve(None).folder)


def _logprobs(token_ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.25 * (k + 1), [(t, -0.25), (t + 1, -1.5)]) for k, t in enumerate(token_ids)]


def _step(i: int) -> list[ChoiceDelta]:
    """Step ``i`` of both choices: two tokens each, with their logprobs."""
    ids = [1000 + 10 * i, 1001 + 10 * i]
    return [ChoiceDelta(k, STEPS[i][k], ids, _logprobs(ids)) for k in range(N)]


def _result(request_id: str, num_prompt_tokens: int) -> JobResult:
    ids = [t for i in range(len(STEPS)) for t in _step(i)[0].token_ids] + [2000]
    choices = [
        ChoiceResult(k, "".join(s[k] for s in STEPS) + TAIL, ids, "length", _logprobs(ids), None) for k in range(N)
    ]
    return JobResult(request_id, MODEL, choices, num_prompt_tokens, N * len(ids), num_cached_tokens=0)


def _frames(bodies: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + dumps_chunk(b).encode() + b"\n\n" for b in bodies)


class _Reader:
    """The response body as it arrives, read a number of SSE events at a time."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self.body = b""

    async def events(self, count: int) -> None:
        while self.body.count(b"\n\n") < count:
            self.body += await anext(self._chunks)

    async def rest(self) -> None:
        async for chunk in self._chunks:
            self.body += chunk


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_stream_bytes_are_the_formatters_chunks(
    api: ServerThread, redis_url: str, tokenizer: PromptTokenizer, kind: Kind
) -> None:
    common = {"model": MODEL, "n": N, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "hi"}]}
        body |= {"logprobs": True, "top_logprobs": 2}
    else:
        path, body = "/v1/completions", {**common, "prompt": "Say:", "logprobs": 2}
    worker = ScriptedWorker(redis_url)
    redis = aioredis.Redis.from_url(redis_url)
    async with (
        httpx.AsyncClient(base_url=api.url, timeout=20) as client,
        client.stream("POST", path, json=body) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache" and resp.headers["x-accel-buffering"] == "no"
        payload = await worker.take()
        writer = JobEventWriter(redis, payload.request_id, 60, channel=payload.reply_channel)
        reader = _Reader(resp.aiter_bytes())
        num_events = N if kind == "chat" else 0  # chat opens with the assistant role, one chunk per choice
        await reader.events(num_events)
        for i in range(len(STEPS)):
            await writer.delta(_step(i))
            num_events += N
            await reader.events(num_events)  # before the next step: the relay has nothing to merge
        result = _result(payload.request_id, len(payload.prompt_token_ids))
        await writer.final(result)
        await reader.rest()
    await redis.aclose()

    first = json.loads(reader.body.split(b"\n\n")[0][len(b"data: ") :])
    fmt = ResponseFormatter(kind, payload.request_id, MODEL, first["created"], tokenizer)
    expected = fmt.start_chunks(N)
    for i in range(len(STEPS)):
        expected += fmt.delta_chunks(DeltaEvent(i, _step(i)))
    expected += fmt.final_chunks(FinalEvent(len(STEPS), result), include_usage=True)
    assert reader.body == _frames(expected) + b"data: [DONE]\n\n"
    texts = [json.loads(e[len(b"data: ") :]) for e in reader.body.split(b"\n\n")[:-2]]
    assert texts == expected  # and so the same chunks once parsed
    assert texts[-1]["usage"]["completion_tokens"] == N * 7 and texts[-1]["choices"] == []


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("echo", [None, "Say: \u00e9\u2028"])
def test_delta_json_is_the_dumped_delta_chunks(tokenizer: PromptTokenizer, kind: Kind, echo: str | None) -> None:
    """The template against ``dumps_chunk(delta_chunks)`` on awkward text and logprobs (-inf and NaN become
    -9999.0), with a choice that has only logprobs, one with neither (no chunk), and an id and model that
    need escaping; both formatters then owe the same final chunks."""
    fast, plain = (ResponseFormatter(kind, 'id-"\u00e9"', "m\\odel", 1700000000, tokenizer, echo) for _ in range(2))
    nasty = ["", "\x00\x1f\x7f", '"\\/', "\u2028\u2029", "\ud7ff\ue000", "🙂" * 3, "\t\r\n\b\f"]
    weird = [TokenLogprob(5, float("-inf"), [(5, float("nan")), (6, -1e-320)]), TokenLogprob(7, 0.0, [(7, -1e300)])]
    for seq, text in enumerate(nasty):
        event = DeltaEvent(
            seq,
            [
                ChoiceDelta(0, text, [5], weird if seq % 2 else None),
                ChoiceDelta(1, "", [7], weird),  # logprobs without text: still a chunk
                ChoiceDelta(2, "", [], None),  # nothing: no chunk
            ],
        )
        assert fast.delta_json(event) == [dumps_chunk(c) for c in plain.delta_chunks(event)]
    result = JobResult("r", MODEL, [ChoiceResult(k, "".join(nasty) + "end", [5], "stop") for k in range(3)], 1, 3)
    final = FinalEvent(len(nasty), result)
    assert fast.final_chunks(final, True) == plain.final_chunks(final, True)
