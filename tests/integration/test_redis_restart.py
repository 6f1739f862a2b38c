"""Every service rides out a Redis restart (issue 14): a real redis-server is SIGKILLed and
restarted on the same port after `OUTAGE_S`, while the services run in this process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.prefill_queue.app import create_app
from services.stage_worker.membership import lease as lease_mod
from services.stage_worker.membership.lease import SlotError, SlotLease
from services.wan_broker.broker import serve as serve_broker
from shared.bus import Bus
from shared.control.health import Heartbeat, live_instances, wait_live
from shared.dataplane.store import RedisStore
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import FIELD, LinkReport, Ping, decode, keys
from tests.integration.test_prefill_api import REQUESTS, settings_for
from tests.integration.test_wan_broker import settings as broker_settings
from tests.integration.test_wan_broker import transfer

#: Longer than a lease's TTL (3 s) and a heartbeat's (6 s is not needed: the key comes back).
OUTAGE_S = 4.0


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EmbeddedRedis]:
    persist = getattr(request, "param", True)
    s = EmbeddedRedis(persist=persist, data_dir=str(tmp_path / "redis")) if persist else EmbeddedRedis()
    if persist:
        (tmp_path / "redis").mkdir()
    s.start()
    yield s
    s.stop()


async def restart_after(server: EmbeddedRedis, outage_s: float = OUTAGE_S) -> float:
    """SIGKILL the server, keep it down `outage_s`, start it again on the same port (and files).
    Returns the wall-clock time it was back."""
    server.kill()
    await asyncio.sleep(outage_s)  # the outage's length is the test's input
    server.start()
    return time.time()


async def beat_since(r: Redis, service: str, since: float, timeout_s: float = 60.0) -> None:
    """Wait until `service` has beaten at or after `since` (wall clock): a heartbeat that met the
    restarted server, not a key restored from its append-only file."""
    async with asyncio.timeout(timeout_s):
        while not any(inst["ts"] >= since for inst in await live_instances(r, service)):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # heartbeats are keys with TTLs: there is no event to wait on


async def test_leases_and_heartbeats_ride_out_a_restart(server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    # Peers are checked again this long after the reconnect (10 s in production): time for each
    # worker to take its lease back (its reconnect backoff, capped at 2 s, plus a renewal period).
    monkeypatch.setattr(lease_mod, "PEER_GRACE_S", 5.0)
    r = Redis.from_url(server.url, protocol=2)
    leases = [SlotLease(r, "rr", 2, 1, holder=f"w{i}") for i in range(2)]
    for ls in leases:
        await ls.acquire()
        ls.check_peers = True  # as after the start barrier: a missing peer would be a failure
    hb = Heartbeat(r, "stage_worker", "rr-0", lambda: {}, interval_s=0.5)
    await hb.start()
    watches = [asyncio.create_task(ls.watch()) for ls in leases]
    restarted = await restart_after(server)
    # No peer check completes while Redis is down; each one from here on comes after the grace.
    checked = [ls.peer_checks for ls in leases]
    check = Redis.from_url(server.url, protocol=2)
    async with asyncio.timeout(60):
        # both take their leases back, then past the grace check each other again, and find each other
        while any(ls.peer_checks == n for ls, n in zip(leases, checked, strict=True)):
            assert not any(w.done() for w in watches), [w.exception() for w in watches if w.done()]
            await asyncio.sleep(0.1)  # the watches poll on their own clock: no event to wait on
    assert [await check.get(keys.lease_key("rr", 0, k)) for k in range(2)] == [b"w0", b"w1"]
    await beat_since(check, "stage_worker", restarted)
    assert not any(w.done() for w in watches), [w.exception() for w in watches if w.done()]
    for w in watches:
        w.cancel()
    await asyncio.gather(*watches, return_exceptions=True)
    await hb.stop()
    await r.aclose()
    await check.aclose()


@pytest.mark.parametrize("server", [False], indirect=True)
async def test_a_restart_without_persistence_fails_the_lease_explicitly(server: EmbeddedRedis) -> None:
    r = Redis.from_url(server.url, protocol=2)
    ls = SlotLease(r, "rr", 1, 1, holder="w0")
    await ls.acquire()
    watch = asyncio.create_task(ls.watch())
    await restart_after(server)
    with pytest.raises(SlotError, match="without persistence"):
        await asyncio.wait_for(watch, 60)
    await r.aclose()


async def test_the_wan_broker_rides_out_a_restart(server: EmbeddedRedis, tmp_path: Path) -> None:
    s = broker_settings(tmp_path, server.url, "temporal")
    stop = asyncio.Event()
    task = asyncio.create_task(serve_broker(s, stop))
    r = Redis.from_url(server.url, protocol=2)
    await wait_live(r, "wan_broker", timeout_s=30)
    await r.aclose()
    events = keys.events_stream(s.run)
    async with Bus(server.url) as bus:
        await bus.publish(keys.wan_stream(s.run), transfer(0, (0,)))
        restarted = await restart_after(server)
        r = Redis.from_url(server.url, protocol=2)
        # its heartbeat and its report loop (reporting the link that carries transfer 0) meet the new server
        await beat_since(r, "wan_broker", restarted)
        last: Any = await r.xrevrange(events, count=1)
        cursor = last[0][0].decode() if last else "0-0"
        reported = False
        async with asyncio.timeout(60):
            while not reported:
                reply: Any = await r.xread({events: cursor}, block=1000)
                for entry_id, fields in reply[0][1] if reply else []:
                    cursor = entry_id.decode()
                    reported = reported or isinstance(decode(fields[FIELD]), LinkReport)
        assert not task.done(), task.exception()
        await bus.publish(keys.wan_stream(s.run), transfer(1, (0,)))  # works after the restart
        seqs: set[int] = set()
        async with asyncio.timeout(60):
            while seqs != {0, 1}:
                rows: Any = await r.xrange("inbox")
                seqs = {m.seq for _, f in rows if isinstance(m := decode(f[FIELD]), Ping)}
                await asyncio.sleep(0.1)
    assert await live_instances(r, "wan_broker")
    stop.set()
    await asyncio.wait_for(task, 30)
    await r.aclose()


async def test_the_front_door_answers_503_while_redis_is_down_and_keeps_accepted_requests(
    server: EmbeddedRedis,
) -> None:
    async with TestClient(TestServer(create_app(settings_for(server.url)))) as c:
        before = await c.post("/v1/prefill", json={"prompt": [1, 2, 3]})
        assert before.status == 202
        rid = (await before.json())["id"]
        server.kill()
        t0 = time.monotonic()
        down = await c.post("/v1/prefill", json={"prompt": [4, 5, 6]})
        assert down.status == 503, await down.text()
        assert down.headers["Retry-After"] == "2" and down.content_type == "application/json"
        assert (await down.json())["error"]["type"] == "service_unavailable"
        assert (await c.get(f"/v1/prefill/{rid}")).status == 503
        assert (await c.get("/health")).status == 503
        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t0)))
        server.start()  # same port, same append-only file
        got = await c.get(f"/v1/prefill/{rid}")
        assert got.status == 200 and (await got.json())["status"] == "queued"  # persisted across the restart
        after = await c.post("/v1/prefill", json={"prompt": [7, 8, 9]})
        assert after.status == 202
        assert (await c.get("/health")).status == 200
    r = Redis.from_url(server.url, protocol=2)
    assert await r.xlen(REQUESTS) == 2  # the accepted one and the one after
    await r.aclose()


async def test_the_data_plane_rendezvous_rides_out_a_restart(server: EmbeddedRedis) -> None:
    """A group forming while Redis restarts (gloo's store calls are blocking, on its own threads):
    the store tries again until Redis answers, and a key written before the outage is still read."""
    store = RedisStore(server.url, "bt:t:plane:1:pair:", timeout_s=30.0)
    try:
        store.set("rank0", b"10.0.0.1:1234")
        server.kill()
        writing = asyncio.create_task(asyncio.to_thread(store.set, "rank1", b"10.0.0.2:5678"))
        await asyncio.sleep(1.0)  # the outage's length is the test's input
        assert not writing.done()  # still trying
        server.start()
        await asyncio.wait_for(writing, 30)
        assert await asyncio.to_thread(store.get, "rank0") == b"10.0.0.1:1234"  # from the append-only file
        assert await asyncio.to_thread(store.get, "rank1") == b"10.0.0.2:5678"
    finally:
        store.close()


async def test_the_data_plane_rendezvous_gives_up_after_its_timeout(server: EmbeddedRedis) -> None:
    store = RedisStore(server.url, "bt:t:plane:1:pair:", timeout_s=1.0)
    try:
        server.kill()
        with pytest.raises(RuntimeError, match="Redis did not answer for 1 s"):
            await asyncio.to_thread(store.set, "rank0", b"x")
    finally:
        store.close()
        server.start()  # the fixture stops it


async def test_a_client_retries_nothing_itself_and_a_pooled_connection_survives_a_restart(
    server: EmbeddedRedis,
) -> None:
    """redis-py retries nothing (every retry is ours: `ride_out`, the consumer loop), so a call
    while Redis is down fails at once; a pooled connection that the restart closed is replaced when
    the pool hands it out, so the first call after the restart succeeds without any retry."""
    from redis.asyncio.retry import Retry
    from redis.exceptions import ConnectionError as RedisConnectionError

    from shared.bus.connection import blocking_client, command_client

    r, reader = command_client(server.url), blocking_client(server.url)
    try:
        for client in (r, reader):
            retry = client.connection_pool.connection_kwargs["retry"]
            assert isinstance(retry, Retry) and retry.get_retries() == 0, retry  # an asyncio Retry
        assert await r.ping() and await reader.ping()
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await r.ping()
        assert time.monotonic() - t0 < 1.0  # no backoff inside redis-py (its old 8 retries took seconds)
        server.start()
        assert await r.ping() and await reader.ping()  # the first call after the restart
    finally:
        await r.aclose()
        await reader.aclose()
