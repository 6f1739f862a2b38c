"""Fixtures shared by every tier. Integration tests get a real redis-server on a free port,
started with the same code the launcher uses (`shared.runtime.redis_server.EmbeddedRedis`).

With ``BUBBLETEA_TEST_REDIS=cluster`` (`make test-cluster`), the `redis_url` and `redis` fixtures
give a Redis Cluster instead (`redis_cluster`: 3 masters, 1 replica each, one a session, from
shared/runtime/redis_cluster.py), so integration tests written for one Redis run on a cluster
unchanged. A test that needs the cluster itself asks for `redis_cluster`.

`--cpu-hogs N` keeps N processes spinning on the CPU for the whole session: the suite run on a
busy machine (`make test-stress`), where which process reaches a receive first, or how long a
sleep really lasts, is the scheduler's choice. Every test must pass that way too."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis, RedisCluster

from shared.bus.connection import client_for
from shared.runtime.logs import KeyValueFormatter
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis

#: ``BUBBLETEA_TEST_REDIS=cluster``: the standard Redis fixtures give a Redis Cluster.
ON_CLUSTER = os.environ.get("BUBBLETEA_TEST_REDIS", "").strip().lower() == "cluster"

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


#: Each tier's marker, by the folder its tests live in (not file by file, where one could be missed).
TIER_MARKERS = {t: t for t in ("integration", "e2e", "compose", "slurm", "browser")}
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(item.fspath).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            continue
        if (marker := TIER_MARKERS.get(tier)) is not None:
            item.add_marker(marker)


def pytest_report_header(config: pytest.Config) -> str | None:
    n = config.getoption("--cpu-hogs")
    return f"cpu hogs: {n} process(es) spinning for the whole session" if n else None


#: Held by the test that has a kernel WAN up (marker kernel_wan). Such runs share what the kernel WAN
#: changes on the host: namespaces, address bases (a second run on a base in use is refused) and
#: ip_forward (restored by the last run out, which a test checks). So they take turns, across
#: pytest-xdist's workers and across sessions on the host: an flock on one file in the system's
#: temporary directory. (xdist's --dist loadgroup would do it by scheduling, but its groups are lost
#: under pytest 9.2: a test's node id can no longer be renamed.)
KERNEL_WAN_LOCK = Path(tempfile.gettempdir()) / "bubbletea-tests-kernel-wan.lock"


@pytest.fixture(autouse=True)
def _kernel_wan_one_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("kernel_wan") is None:
        yield
        return
    with KERNEL_WAN_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


@pytest.fixture(scope="session", autouse=True)
def _kv_logs() -> None:
    for h in logging.getLogger().handlers:
        h.setFormatter(KeyValueFormatter())


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedCluster]:
    """The session's embedded Redis Cluster (3 masters, 1 replica each). A test that kills a node
    starts a cluster of its own instead."""
    cluster = EmbeddedCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
async def redis_url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """URL of a clean database on the session's private redis-server (or, under
    ``BUBBLETEA_TEST_REDIS=cluster``, of the session's cluster, every master flushed)."""
    server: EmbeddedRedis | EmbeddedCluster = request.getfixturevalue("redis_cluster" if ON_CLUSTER else "redis_server")
    r = client_for(server.url)
    if isinstance(r, RedisCluster):
        await r.flushall(target_nodes=RedisCluster.PRIMARIES)
    else:
        await r.flushall()
    await r.aclose()
    yield server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    # socket_timeout=None, as the bus's clients: with redis-py 8's defaults a task cancelled during a
    # command may go on (tests/integration/test_redis_cancellation.py). A RedisCluster on a cluster.
    r = client_for(redis_url, socket_timeout=None)
    yield r
    await r.aclose()
