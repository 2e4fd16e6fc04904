"""/v1/completions with several prompts, as OpenAI and vLLM take them: one job per prompt (the jobs spread
over workers and share the continuous batch like any other requests), answered as one response whose choices
are numbered prompt-major (``index = prompt * n + j``), with the usage of all prompts added up. The first
error ends the whole request and aborts the prompts still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from api.formatting import ResponseFormatter
from api.relay import Subscription
from api.service import CompletionService, PreparedRequest
from api.streams import DONE, collect, job_chunks
from wire.messages import ChoiceResult, JobResult

Source = tuple[PreparedRequest, Subscription | None, JobResult | None]  # (job, its events | its cached answer)


async def start_all(svc: CompletionService, preps: list[PreparedRequest]) -> list[Source]:
    """Each prompt's cached answer or its subscribed-and-enqueued job; on failure, release what started."""
    sources: list[Source] = []
    try:
        for prep in preps:
            started = await svc.start(prep)
            if isinstance(started, JobResult):
                sources.append((prep, None, started))
            else:
                sources.append((prep, started, None))
    except BaseException:
        for _, sub, _ in sources:
            if sub is not None:
                svc.spawn(svc.release(sub, abort=True))
        raise
    return sources


def merge_results(batch_id: str, sources: list[Source], results: list[JobResult]) -> JobResult:
    choices = [
        ChoiceResult(i * prep.n + c.index, c.text, c.token_ids, c.finish_reason, c.logprobs, c.stop_reason)
        for i, ((prep, _, _), result) in enumerate(zip(sources, results, strict=True))
        for c in result.choices
    ]
    return JobResult(
        batch_id,
        results[0].model,
        choices,
        sum(r.prompt_tokens for r in results),
        sum(r.completion_tokens for r in results),
        sum(r.num_cached_tokens for r in results),
    )


async def collect_all(svc: CompletionService, sources: list[Source], request: Request) -> list[JobResult]:
    """Every prompt's result; the first failure cancels (and so aborts) the others and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(collect(svc, prep, sub, request)) if sub is not None else None
                for prep, sub, _ in sources
            ]
    except* Exception as errors:  # the first failure as itself (an ApiError keeps its status, Redis its 503)
        raise errors.exceptions[0] from None
    results = []
    for task, (_, _, cached) in zip(tasks, sources, strict=True):
        result = cached if task is None else task.result()
        assert result is not None
        results.append(result)
    return results


def response_body(svc: CompletionService, batch_id: str, sources: list[Source], results: list[JobResult]) -> Any:
    first = sources[0][0]
    fmt = ResponseFormatter("completion", batch_id, first.model, first.created, svc.tokenizer)
    body = fmt.response(merge_results(batch_id, sources, results))
    for choice in body["choices"]:  # each prompt echoes its own text
        echo = sources[choice["index"] // first.n][0].echo
        if echo is not None:
            choice["text"] = echo + choice["text"]
    return body


async def batch_stream(
    svc: CompletionService, batch_id: str, sources: list[Source], include_usage: bool
) -> AsyncIterator[str]:
    """One OpenAI stream of all prompts' chunks as they come, choices renumbered; a usage chunk last."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()

    async def pump(i: int, prep: PreparedRequest, sub: Subscription | None, cached: JobResult | None) -> None:
        prep.include_usage = True  # the sum is sent once, at the end
        chunks = job_chunks(svc, prep, sub, cached)
        try:
            async for chunk in chunks:
                await queue.put((i, chunk))
        finally:
            await chunks.aclose()
            queue.put_nowait((i, None))

    pumps = [asyncio.create_task(pump(i, *source)) for i, source in enumerate(sources)]
    usage: dict[str, int] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached_tokens = 0
    try:
        remaining = len(pumps)
        while remaining:
            i, chunk = await queue.get()
            if chunk is None:
                remaining -= 1
                continue
            if "error" in chunk:
                yield json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
                break
            if "usage" in chunk and not chunk["choices"]:
                for key in usage:
                    usage[key] += chunk["usage"][key]
                cached_tokens += chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                continue
            n = sources[i][0].n
            chunk = {**chunk, "id": batch_id, "choices": [{**c, "index": i * n + c["index"]} for c in chunk["choices"]]}
            yield json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
        else:
            if include_usage:
                first = sources[0][0]
                fmt = ResponseFormatter("completion", batch_id, first.model, first.created, svc.tokenizer)
                yield json.dumps(fmt.chunk([], {**usage, "prompt_tokens_details": {"cached_tokens": cached_tokens}}))
        yield DONE
    finally:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
