"""Shared fixtures: a private redis-server on a free port (CI machines have none running), flushed per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from deploy.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The private server's URL, with an empty database for each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()
