"""Fixtures shared by every tier. Integration tests get a real redis-server on a free port,
started with the same code the launcher uses (`shared.redis_server.EmbeddedRedis`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from shared.logs import KeyValueFormatter
from shared.redis_server import EmbeddedRedis


@pytest.fixture(scope="session", autouse=True)
def _kv_logs() -> None:
    for h in logging.getLogger().handlers:
        h.setFormatter(KeyValueFormatter())


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture
async def redis_url(redis_server: EmbeddedRedis) -> AsyncIterator[str]:
    """URL of a clean database on the session's private redis-server."""
    r = Redis.from_url(redis_server.url, protocol=2)
    await r.flushall()
    await r.aclose()
    yield redis_server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_url, protocol=2)
    yield r
    await r.aclose()
