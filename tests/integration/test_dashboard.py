"""The live page (services/prefill_queue/dashboard.py) against a real redis-server: the page, its
server-sent events built from what the run's streams and keys hold, the API key, and a page that
does not keep up being dropped."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.prefill_queue import dashboard
from services.prefill_queue.app import create_app
from shared.config.settings import Settings, load_settings
from shared.wire import FIELD, IterationDone, LinkReport, Message, SpanRecord, WorkerFailed, encode, keys

RUN = "dash"


def settings_for(url: str, **env: str) -> Settings:
    return load_settings(env={"REDIS_URL": url, "BUBBLETEA_RUN": RUN, **env})


async def put(redis: Redis, stream: str, *msgs: Message) -> None:
    for m in msgs:
        await redis.xadd(stream, {FIELD: encode(m)})


def spans(t0: float) -> list[SpanRecord]:
    """Worker (stage 1, replica 0): forward, a bubble with prefill inside, backward."""
    s = dict(run=RUN, replica=0, stage=1, iteration=1)
    return [
        SpanRecord(**s, span="fwd", start=t0, end=t0 + 0.01),
        SpanRecord(**s, span="wait", start=t0 + 0.01, end=t0 + 0.05, predicted_ms=40.0, input_at=t0 + 0.05),
        SpanRecord(**s, span="prefill", start=t0 + 0.02, end=t0 + 0.04),
        SpanRecord(**s, span="bwd", start=t0 + 0.05, end=t0 + 0.07),
    ]


async def read_event(resp: Any) -> tuple[str, dict[str, Any]]:
    name, data = "", ""
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), 10)).decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and name:
            return name, json.loads(data)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(settings_for(redis_url)))) as c:
        yield c


async def test_the_page_is_self_contained_and_names_the_contract(client: TestClient) -> None:
    resp = await client.get("/dashboard")
    assert resp.status == 200 and resp.content_type == "text/html"
    html = await resp.text()
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", html), "no external URL"
    for part in ('id="timeline"', 'id="time-scale"', 'id="wan"', 'id="faults"', 'id="figures"'):
        assert part in html


async def test_snapshot_then_updates_from_the_runs_streams(client: TestClient, redis: Redis) -> None:
    t0 = time.time()
    await put(redis, keys.spans_stream(RUN), *spans(t0))
    await put(
        redis,
        keys.events_stream(RUN),
        IterationDone(run=RUN, replica=0, stage=1, iteration=1, started=t0, ended=t0 + 0.07, loss=2.5),
        LinkReport(
            run=RUN, src_dc="a", dst_dc="b", utilization=0.3, bytes_sent=1e6, transfers=7, in_flight=1, late_p99_ms=0.1
        ),
    )
    async with client.get("/dashboard/events") as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        name, view = await read_event(resp)
        assert name == "snapshot" and view["run"] == RUN and view["time_scale"] == 1.0
        kinds = {(s[1], s[2]) for s in view["segments"]}
        assert kinds == {("1.0", "compute"), ("1.0", "bubble"), ("1.0", "prefill")}
        figures = {f["name"]: f for f in view["figures"]}
        assert figures["loss"]["value"] == 2.5
        assert figures["answered-total"]["metric"] == 'bubbletea:request_total{outcome="success"}'
        assert [link["link"] for link in view["wan"]] == ["a->b"]
        assert view["wan"][0]["transfers"] == 7

        await put(redis, keys.events_stream(RUN), WorkerFailed(run=RUN, slot="r0s1", reason="killed"))
        await put(redis, keys.spans_stream(RUN), *spans(t0 + 0.1))
        faults: list[dict[str, Any]] = []
        while not faults:
            name, update = await read_event(resp)
            assert name == "update"
            faults = update["faults"]
        assert faults[0]["kind"] == "worker-lost" and faults[0]["worker"] == "1.0"
        assert update["seq"] == 8
    metrics = await (await client.get("/metrics")).text()
    assert 'bubbletea:request_total{outcome="success"} 0.0' in metrics  # the page's totals are on /metrics


async def test_a_malformed_entry_on_the_runs_streams_is_skipped_and_the_page_reads_on(
    client: TestClient, redis: Redis
) -> None:
    """The page only watches the streams (their consumers dead-letter what is malformed): an entry
    that is not a message, or has no message field, is passed over and what follows is drawn."""
    await redis.xadd(keys.spans_stream(RUN), {FIELD: b"not msgpack"})
    await redis.xadd(keys.spans_stream(RUN), {b"other": b"x"})
    await put(redis, keys.spans_stream(RUN), *spans(time.time()))
    async with client.get("/dashboard/events") as resp:
        name, view = await read_event(resp)
        assert name == "snapshot"
        assert {s[2] for s in view["segments"]} == {"compute", "bubble", "prefill"}
        await redis.xadd(keys.events_stream(RUN), {FIELD: b"\xff"})
        await put(redis, keys.events_stream(RUN), WorkerFailed(run=RUN, slot="r0s1", reason="killed"))
        faults: list[dict[str, Any]] = []
        while not faults:
            name, update = await read_event(resp)
            faults = update["faults"]
        assert faults[0]["kind"] == "worker-lost"


async def test_a_page_that_stops_reading_is_dropped_after_its_write_times_out(
    redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A page whose host vanished without a FIN, or that stopped reading, blocks the writes to it
    once the buffers fill: its handler ends after `WRITE_S` rather than when TCP gives up. Here a
    client with a small receive buffer asks for the events and never reads a byte."""
    monkeypatch.setattr(dashboard, "WRITE_S", 0.5)
    caplog.set_level(logging.INFO, logger=dashboard.__name__)
    async with TestServer(create_app(settings_for(redis_url))) as server:
        hub = server.app[dashboard.DASHBOARD]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
        try:
            request = f"GET /dashboard/events HTTP/1.1\r\nHost: {server.host}\r\n\r\n".encode()
            await asyncio.get_running_loop().sock_sendall(sock, request)
            await _until(lambda: len(hub.clients) == 1)

            async def spans_on() -> None:  # updates of some size, until the buffers between are full
                while True:
                    await put(redis, keys.spans_stream(RUN), *[sp for j in range(200) for sp in spans(time.time())])
                    await asyncio.sleep(0.05)

            feeding = asyncio.create_task(spans_on())
            try:
                # its handler's write timed out (the hub alone would only stop queueing to it)
                await _until(lambda: any("stopped reading" in r.getMessage() for r in caplog.records), timeout=60)
                assert not hub.clients
            finally:
                feeding.cancel()
                await asyncio.gather(feeding, return_exceptions=True)
        finally:
            sock.close()


async def test_a_lost_lease_then_a_new_holder_is_a_fault_and_a_takeover(client: TestClient, redis: Redis) -> None:
    lease = keys.lease_key(RUN, 0, 0)
    await redis.set(lease, "h1")
    hub = client.app[dashboard.DASHBOARD]
    await _until(lambda: hub._holders.get("0.0") == "h1")
    await redis.delete(lease)
    await _until(lambda: any(f.kind == "worker-lost" for f in hub.view._faults))
    await redis.set(lease, "h3")
    await _until(lambda: any(f.kind == "takeover" for f in hub.view._faults))
    taken = next(f for f in hub.view._faults if f.kind == "takeover")
    assert taken.worker == "0.0" and "h3" in taken.text


async def test_the_generation_moving_as_workers_join_is_no_recovery_and_a_move_after_training_is(
    client: TestClient, redis: Redis
) -> None:
    """Every starting worker moves the run's generation on as it joins (INCR): before the run has
    trained, those moves are its formation, not a fault; a move once it has trained is a recovery."""
    gen = keys.generation_key(RUN)
    hub = client.app[dashboard.DASHBOARD]
    for g in (1, 2, 3, 4):  # four workers join
        await redis.set(gen, g)
        await _until(lambda g=g: hub._generation == g)
    assert not any(f.kind == "recovery" for f in hub.view._faults)
    t0 = time.time()
    await put(
        redis,
        keys.events_stream(RUN),
        IterationDone(run=RUN, replica=0, stage=1, iteration=1, started=t0, ended=t0 + 0.07, loss=2.5),
    )
    await _until(lambda: hub.view.trained)
    await redis.set(gen, 5)  # a replacement joined after a loss
    await _until(lambda: any(f.kind == "recovery" for f in hub.view._faults))
    assert [f.text for f in hub.view._faults if f.kind == "recovery"] == ["the run moved to recovery generation 5"]


async def test_a_new_dispatcher_leading_is_a_restart_on_the_live_page(client: TestClient, redis: Redis) -> None:
    lease = keys.dispatcher_lease_key(RUN)
    await redis.set(lease, "dispatcher-h1")
    hub = client.app[dashboard.DASHBOARD]
    await _until(lambda: hub._dispatcher.get(None) == "dispatcher-h1")
    await redis.set(lease, "dispatcher-h2")
    await _until(lambda: any(f.kind == "dispatcher-restart" for f in hub.view._faults))
    (restart,) = [f.text for f in hub.view._faults if f.kind == "dispatcher-restart"]
    assert restart == "dispatcher dispatcher-h2 leads the run (was dispatcher-h1)"


async def test_with_a_dispatcher_per_datacenter_a_new_leader_of_one_is_its_restart(
    redis_url: str, redis: Redis
) -> None:
    settings = settings_for(redis_url, BUBBLETEA_DISPATCH="per_dc")
    async with TestClient(TestServer(create_app(settings))) as c:
        hub = c.app[dashboard.DASHBOARD]
        a, b = keys.dispatcher_lease_key(RUN, "dc-a"), keys.dispatcher_lease_key(RUN, "dc-b")
        await redis.set(a, "dispatcher-a1")
        await redis.set(b, "dispatcher-b1")
        await _until(lambda: hub._dispatcher == {"dc-a": "dispatcher-a1", "dc-b": "dispatcher-b1"})
        await redis.set(a, "dispatcher-a2")
        await _until(lambda: any(f.kind == "dispatcher-restart" for f in hub.view._faults))
        restarts = [f.text for f in hub.view._faults if f.kind == "dispatcher-restart"]
        assert restarts == ["dispatcher dispatcher-a2 leads datacenter dc-a (was dispatcher-a1)"]


async def _until(cond: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # noqa: ASYNC110 (the hub's state has no event to wait on)
            await asyncio.sleep(0.05)


async def test_the_api_key_guards_the_page_and_its_events(redis_url: str) -> None:
    app = create_app(settings_for(redis_url, BUBBLETEA_API_KEY="sesame"))
    async with TestClient(TestServer(app)) as c:
        assert (await c.get("/dashboard")).status == 401
        assert (await c.get("/dashboard/events")).status == 401
        assert (await c.get("/dashboard?key=wrong")).status == 401
        assert (await c.get("/dashboard?key=sesame")).status == 200
        async with c.get("/dashboard/events", headers={"Authorization": "Bearer sesame"}) as resp:
            assert (await read_event(resp))[0] == "snapshot"
        async with c.get("/dashboard/events?key=sesame") as resp:
            assert (await read_event(resp))[0] == "snapshot"


async def test_a_page_that_does_not_keep_up_is_dropped(client: TestClient) -> None:
    hub = client.app[dashboard.DASHBOARD]
    q: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=dashboard.CLIENT_QUEUE)
    hub.clients.add(q)  # a page that never reads
    await _until(lambda: q not in hub.clients, timeout=dashboard.UPDATE_EVERY_S * (dashboard.CLIENT_QUEUE + 4))
    assert q.qsize() <= dashboard.CLIENT_QUEUE
    items = [q.get_nowait() for _ in range(q.qsize())]
    assert items[-1] is None  # its handler ends
