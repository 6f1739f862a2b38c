"""The embedded Redis: binary discovery, the packaged fallback, clean stops."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from shared.bus import Bus, Delivery
from shared.config.spec import BusConfig
from shared.runtime.redis_server import EmbeddedRedis, RedisServerError, find_redis_server, packaged_redis_server
from shared.wire import Ping


def test_packaged_binary_is_used_when_none_is_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("BUBBLETEA_REDIS_SERVER", raising=False)
    assert find_redis_server() == packaged_redis_server() is not None


def test_explicit_binary_must_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BUBBLETEA_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(RedisServerError, match="not an executable"):
        find_redis_server()


async def test_the_bus_works_on_the_packaged_redis_server() -> None:
    """The packaged binary is Redis 6.2: its XAUTOCLAIM reply has no deleted-ids part."""
    binary = packaged_redis_server()
    assert binary is not None
    async with EmbeddedRedis(binary=binary) as server:
        seen: list[int] = []
        all_done = asyncio.Event()

        async def flaky(d: Delivery) -> None:
            assert isinstance(d.message, Ping)
            if d.attempt == 1 and d.message.seq == 0:
                raise RuntimeError("first try fails")  # forces a reclaim through XAUTOCLAIM
            seen.append(d.message.seq)
            if len(set(seen)) == 10:
                all_done.set()

        async with Bus(server.url, BusConfig(claim_idle_ms=100)) as bus, bus.consumer("s", "g", {Ping: flaky}) as c:
            info = await bus.redis.info("server")
            assert str(info["redis_version"]).startswith("6.2")
            await bus.publish_many("s", [Ping(seq=i, sent_ns=0) for i in range(10)])
            await asyncio.wait_for(all_done.wait(), 60)
        assert c.stats.reclaimed == 1 and sorted(seen) == list(range(10))


def test_stop_removes_the_process_and_its_data() -> None:
    server = EmbeddedRedis().start()
    assert server.proc is not None
    pid, data_dir = server.proc.pid, server.data_dir
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not Path(data_dir).exists()


async def test_the_embedded_server_has_a_memory_limit_and_never_evicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work is never evicted silently: maxmemory with noeviction (writes fail at the limit)."""
    from redis.asyncio import Redis
    from redis.exceptions import ResponseError

    from shared.runtime.redis_server import DEFAULT_MAXMEMORY

    monkeypatch.delenv("BUBBLETEA_REDIS_MAXMEMORY", raising=False)
    assert DEFAULT_MAXMEMORY == "1gb"
    async with EmbeddedRedis() as server:
        r = Redis.from_url(server.url)
        assert await r.config_get("maxmemory") == {"maxmemory": str(1 << 30)}
        assert await r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        await r.aclose()
    monkeypatch.setenv("BUBBLETEA_REDIS_MAXMEMORY", "2mb")
    async with EmbeddedRedis() as server:
        r = Redis.from_url(server.url)
        assert await r.config_get("maxmemory") == {"maxmemory": str(2 << 20)}
        with pytest.raises(ResponseError, match="maxmemory"):  # at the limit a write fails, nothing is evicted
            for i in range(100):
                await r.set(f"k{i}", b"x" * 100_000)
        assert await r.get("k0") == b"x" * 100_000
        await r.aclose()


def test_a_port_another_redis_server_holds_is_not_taken_for_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A free port chosen, then taken by another server before this one binds it (the suite starts
    many at once): another answering there does not pass for this one. Given that port, the start
    fails saying so; with a port it chose, it takes another."""
    from shared.runtime import redis_server

    stranger = EmbeddedRedis().start()
    try:
        with pytest.raises(redis_server.PortTaken, match=r"port \d+ is taken by another process"):
            EmbeddedRedis(port=stranger.port).start()
        ports = iter([stranger.port, redis_server.free_port()])
        monkeypatch.setattr(redis_server, "free_port", lambda: next(ports))
        ours = EmbeddedRedis().start()
        try:
            assert ours.port != stranger.port and ours.proc is not None
            assert redis_server._answering_pid(ours.port) == ours.proc.pid
            assert redis_server._answering_pid(stranger.port) != ours.proc.pid
        finally:
            ours.stop()
    finally:
        stranger.stop()
