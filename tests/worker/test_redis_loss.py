"""A worker that loses Redis for longer than its jobs' lease: real Redis (SIGKILLed), real uvicorn, real worker
processes on the CPU.

The worker cannot renew its running jobs' leases, so once Redis is back another worker may take them: it must
not go on writing their events. It exits with ``EXIT_REDIS_LOST`` as soon as the lease has run out; after
Redis' restart another worker (started during the outage) picks the job up and the client's greedy stream goes on
exactly where it stopped (the API waited through the outage).
"""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import pytest

from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, start_api
from tests.api.test_failover import LEASE_S, StreamReader, post_in_thread, start_worker, wait_ready
from worker.node import EXIT_REDIS_LOST

pytestmark = pytest.mark.slow


def test_worker_without_redis_past_its_lease_exits_and_its_stream_continues_elsewhere() -> None:
    body = {"model": MODEL, "prompt": "Tell me about the moon.", "max_tokens": 48, "ignore_eos": True}
    with RedisServer(appendonly=True) as redis:
        api = start_api(redis, response_cache=False)
        worker_a = start_worker(redis.url, "redis-loss-a")
        worker_b: subprocess.Popen[bytes] | None = None
        try:
            wait_ready(api, 1, worker_a)
            reader = StreamReader(api.url, {**body, "temperature": 0.0, "stream": True})
            reader.start()
            assert reader.started.wait(120) and not reader.done
            assert redis.proc is not None
            redis.proc.send_signal(signal.SIGKILL)
            redis.proc.wait()
            killed_at = time.monotonic()
            # worker B starts while Redis is down (a worker waits for Redis to answer, worker.main.connect): its
            # model loads while worker A runs out its lease, instead of after Redis' restart
            worker_b = start_worker(redis.url, "redis-loss-b")
            assert worker_a.wait(30) == EXIT_REDIS_LOST
            assert time.monotonic() - killed_at < LEASE_S + 5, "the worker held its jobs well past their lease"
            redis.start()
            deadline = time.monotonic() + 30  # the API's Redis answers again before the reference is sent
            while httpx.get(api.url + "/ready/api").status_code != 200:
                assert time.monotonic() < deadline, "the API did not reconnect to Redis"
                time.sleep(0.1)
            reference = post_in_thread(api.url, {**body, "temperature": 0.0})  # beside the stream worker B continues
            reader.join(150)
            assert not reader.is_alive(), "the stream hangs after its worker lost Redis"
            assert reader.errors == [] and reader.done
            assert reader.text == reference.result()["choices"][0]["text"]
        finally:
            for w in (worker_a, worker_b):
                if w is not None and w.poll() is None:
                    w.kill()
                    w.wait()
            api.stop()
