"""/ready/api (the API pods' readiness probe in deploy/k8s) means "this API process can serve": 200 while its
Redis answers, with or without workers; /ready stays the whole system's (503 without a live worker)."""

from __future__ import annotations

import httpx

from deploy.redis_server import RedisServer
from tests.api.conftest import start_api


def test_ready_api_without_workers_while_ready_says_no_live_worker(redis_server: RedisServer, redis_url: str) -> None:
    api = start_api(redis_server)  # after redis_url's flush: no heartbeat left by another test
    try:
        whole = httpx.get(api.url + "/ready", timeout=5)
        assert whole.status_code == 503 and whole.json()["status"] == "no live worker"
        mine = httpx.get(api.url + "/ready/api", timeout=5)
        assert mine.status_code == 200 and mine.json() == {"status": "ready"}
    finally:
        api.stop()
