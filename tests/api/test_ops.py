"""Backpressure (429 + Retry-After), auth and per-key rate limit, /health, /ready, /metrics, queue deadline,
Redis down → 503, and the API tier staying free of torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api
from wire import keys
from wire.messages import WorkerHeartbeat

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def small_queue_api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(
        redis_server,
        max_queue_depth=2,
        retry_after_s=3,
        queue_deadline_s=0.5,
        request_timeout_s=3.0,
        api_keys=("key-1", "key-2"),
        rate_limit_rps=1.0,
        rate_limit_burst=5,
    )
    yield server
    server.stop()


def _post(api: ServerThread, key: str = "key-1", path: str = "/v1/jobs") -> httpx.Response:
    return httpx.post(api.url + path, json=BODY, headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_429_when_queue_full(small_queue_api: ServerThread, redis_url: str) -> None:
    assert _post(small_queue_api).status_code == 202
    assert _post(small_queue_api, "key-2").status_code == 202
    resp = _post(small_queue_api, "key-2")
    assert resp.status_code == 429
    assert int(resp.headers["Retry-After"]) >= 3
    assert resp.json()["error"]["code"] == "queue_full"
    client = openai.OpenAI(base_url=small_queue_api.url + "/v1", api_key="key-2", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert 'pagedserve:requests_rejected_total{reason="queue_full"}' in httpx.get(small_queue_api.url + "/metrics").text


def test_auth_and_rate_limit(small_queue_api: ServerThread, redis_url: str) -> None:
    url = small_queue_api.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == "invalid_api_key"
    codes = [httpx.get(url, headers={"Authorization": "Bearer key-1"}).status_code for _ in range(7)]
    assert codes[:5] == [200] * 5 and codes[-1] == 429  # burst of 5, then 1/s
    limited = httpx.get(url, headers={"Authorization": "Bearer key-1"})
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
    assert httpx.get(url, headers={"Authorization": "Bearer key-2"}).status_code == 200  # its own bucket
    assert httpx.get(small_queue_api.url + "/health").status_code == 200  # operations need no key


def test_queue_deadline_gives_a_clear_error(small_queue_api: ServerThread, redis_url: str) -> None:
    # no worker takes the job: it leaves the queue at its deadline with a clear error, not a hang
    t0 = time.monotonic()
    resp = _post(small_queue_api, "key-2", "/v1/completions")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_deadline_exceeded"
    assert time.monotonic() - t0 < 10


async def test_silent_worker_gives_a_timeout(small_queue_api: ServerThread, redis_url: str) -> None:
    # a worker takes the job and never answers: the API gives up after request_timeout_s (504)
    worker = ScriptedWorker(redis_url)
    t0 = time.monotonic()
    resp, _ = await asyncio.gather(asyncio.to_thread(_post, small_queue_api, "key-1", "/v1/completions"), worker.take())
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout"
    assert 3.0 <= time.monotonic() - t0 < 10


def test_ready_follows_worker_heartbeats(api: ServerThread, redis_url: str) -> None:
    assert httpx.get(api.url + "/health").json() == {"status": "ok"}
    assert httpx.get(api.url + "/ready").status_code == 503
    r = redis.Redis.from_url(redis_url)
    beat = WorkerHeartbeat(
        "w1",
        MODEL,
        capacity=8,
        max_model_len=8192,
        num_running=3,
        kv_cache_usage=0.25,
        prompt_tokens_total=100,
        num_swapped=2,
        cpu_kv_cache_usage=0.5,
        time=time.time(),
    )
    r.set(keys.worker_key("w1"), beat.to_json(), ex=10)
    r.zadd(keys.WORKERS, {"w1": beat.time})
    ready = httpx.get(api.url + "/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == 1
    text = httpx.get(api.url + "/metrics").text
    for line in (
        "pagedserve:num_requests_running 3.0",
        "pagedserve:kv_cache_usage_perc 0.25",
        "pagedserve:num_requests_swapped 2.0",
        "pagedserve:cpu_cache_usage_perc 0.5",
        "pagedserve:prompt_tokens_total 100.0",
        "pagedserve:num_workers 1.0",
    ):
        assert line in text
    for name in (  # vLLM's names for what the API measures (tests/api/test_metrics_vllm.py has the rest)
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:inter_token_latency_seconds",
        "pagedserve:prefix_cache_hits_total",
        "pagedserve:num_preemptions_total",
    ):
        assert name in text


async def test_redis_down_is_503() -> None:
    server = RedisServer().start()
    api = start_api(server)
    try:
        server.stop()
        await asyncio.sleep(0.1)
        resp = httpx.post(api.url + "/v1/completions", json=BODY, timeout=20)
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(api.url + "/ready", timeout=20).status_code == 503
    finally:
        api.stop()


def test_api_never_imports_torch(redis_server: RedisServer) -> None:
    script = textwrap.dedent(f"""
        import asyncio, sys
        import api.app
        assert "torch" not in sys.modules and "engine" not in sys.modules, "import api.app pulled in torch/engine"
        from api.settings import ApiSettings
        app = api.app.create_app(ApiSettings(redis_url={redis_server.url!r}))
        async def main():
            async with app.router.lifespan_context(app):
                svc = app.state.svc
                assert svc.tokenizer.encode_chat([{{"role": "user", "content": "hi"}}])
        asyncio.run(main())
        bad = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "engine")))
        assert not bad, bad
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
