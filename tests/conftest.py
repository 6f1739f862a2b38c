"""Fixtures shared by every tier. Integration tests get a real redis-server on a free port,
started with the same code the launcher uses (`shared.runtime.redis_server.EmbeddedRedis`).

`--cpu-hogs N` keeps N processes spinning on the CPU for the whole session: the suite run on a
busy machine (`make test-stress`), where which process reaches a receive first, or how long a
sleep really lasts, is the scheduler's choice. Every test must pass that way too."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from shared.runtime.logs import KeyValueFormatter
from shared.runtime.redis_server import EmbeddedRedis

_HOGS = pytest.StashKey[list[subprocess.Popen[bytes]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hogs",
        type=int,
        default=0,
        metavar="N",
        help="keep N processes spinning on the CPU while the tests run (a busy machine; default 0)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if (n := config.getoption("--cpu-hogs")) < 0:
        raise pytest.UsageError(f"--cpu-hogs: expected a number >= 0, got {n}")
    # The hogs belong to the session, not to each of its workers (pytest-xdist, `make test`'s -n):
    # only the process that started the session starts them.
    if not hasattr(config, "workerinput"):
        config.stash[_HOGS] = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def pytest_unconfigure(config: pytest.Config) -> None:
    for hog in config.stash.get(_HOGS, []):
        hog.kill()
        hog.wait()


def pytest_report_header(config: pytest.Config) -> str | None:
    n = config.getoption("--cpu-hogs")
    return f"cpu hogs: {n} process(es) spinning for the whole session" if n else None


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
