"""Tenants with API keys: the response cache is per key (or shared when asked), X-Cache says hit or miss, and
a job is visible only to the key that created it (another key gets 404 on its status, events and DELETE)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire import keys

GREEDY = {"model": MODEL, "prompt": "what is 2+2?", "max_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def keyed_api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(redis_server, api_keys=("k1", "k2"))
    yield server
    server.stop()


async def _complete(api: ServerThread, key: str, worker: ScriptedWorker | None) -> tuple[str, str]:
    """(text, X-Cache) of GREEDY through the openai client; ``worker`` answers the job if one is queued."""
    client = openai.AsyncOpenAI(base_url=api.url + "/v1", api_key=key, max_retries=0)
    call = client.completions.with_raw_response.create(**GREEDY)  # type: ignore[call-overload]
    if worker is None:
        raw = await call
    else:
        raw, _ = await asyncio.gather(call, worker.serve())
    return raw.parse().choices[0].text, raw.headers["X-Cache"]


async def test_cache_is_per_key(keyed_api: ServerThread, redis_url: str) -> None:
    worker = ScriptedWorker(redis_url, pieces=["four"])
    assert await _complete(keyed_api, "k1", worker) == ("four", "miss")
    assert await _complete(keyed_api, "k1", None) == ("four", "hit")  # no job queued: from k1's cache
    other = ScriptedWorker(redis_url, pieces=["4"])
    assert await _complete(keyed_api, "k2", other) == ("4", "miss")  # k1's answer is not served to k2
    assert len(other.payloads) == 1
    assert await _complete(keyed_api, "k2", None) == ("4", "hit")
    assert await _complete(keyed_api, "k1", None) == ("four", "hit")
    assert redis.Redis.from_url(redis_url).zcard(keys.QUEUE) == 0


async def test_shared_cache_when_asked(redis_server: RedisServer, redis_url: str) -> None:
    api = start_api(redis_server, api_keys=("k1", "k2"), shared_response_cache=True)
    try:
        assert await _complete(api, "k1", ScriptedWorker(redis_url, pieces=["four"])) == ("four", "miss")
        assert await _complete(api, "k2", None) == ("four", "hit")
    finally:
        api.stop()


async def test_stream_says_cache_hit(keyed_api: ServerThread, redis_url: str) -> None:
    body = {**GREEDY, "stream": True}
    headers = {"Authorization": "Bearer k1"}
    async with httpx.AsyncClient(timeout=30) as client:
        resp, _ = await asyncio.gather(
            client.post(keyed_api.url + "/v1/completions", json=body, headers=headers),
            ScriptedWorker(redis_url).serve(),
        )
        assert resp.status_code == 200 and resp.headers["X-Cache"] == "miss"
        again = await client.post(keyed_api.url + "/v1/completions", json=body, headers=headers)
        assert again.headers["X-Cache"] == "hit" and "Hello, world!" in "".join(again.text.split("\n"))
        unauthorized = await client.post(keyed_api.url + "/v1/completions", json=body)
        assert unauthorized.status_code == 401


def test_jobs_belong_to_their_key(keyed_api: ServerThread, redis_url: str) -> None:
    def call(method: str, path: str, key: str) -> httpx.Response:
        return httpx.request(
            method, keyed_api.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
        )

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    created = call("POST", "/v1/jobs", "k1")
    assert created.status_code == 202
    job_id = created.json()["id"]
    body = {}
    for method, path in (
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/events"),
        ("DELETE", f"/v1/jobs/{job_id}"),
    ):
        resp = call(method, path, "k2")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "job_not_found", (method, path)
    assert not redis.Redis.from_url(redis_url).zscore(keys.ARQ_ABORT_SET, job_id)  # k2's DELETE did nothing
    assert call("GET", f"/v1/jobs/{job_id}", "k1").json()["status"] == "queued"
    assert call("DELETE", f"/v1/jobs/{job_id}", "k1").json()["status"] == "cancelling"
    assert call("GET", f"/v1/jobs/{job_id}", "nope").status_code == 401
