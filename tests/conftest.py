"""Shared fixtures: a private redis-server on a free port (CI machines have none running), flushed per test."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from deploy.redis_server import RedisServer

# Without a GPU the Triton kernels run through the interpreter. The flag is read when ``@triton.jit``
# decorates, so it must be set before any test module imports a kernel (engine tests import them too).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    from deploy.redis_server import RedisServer  # imported here so GPU machines without redis can run tests

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The private server's URL, with an empty database for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()
