"""The wan_broker over a real redis-server: policy order, emulated timing, bad requests."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from redis.asyncio import Redis

from services.wan_broker import broker as broker_module
from services.wan_broker import links
from services.wan_broker.broker import serve
from services.wan_broker.links import SETTLE_S, LinkDriver
from shared.bus import Bus
from shared.bus.connection import blocking_client
from shared.config.settings import Settings, load_settings
from shared.control.health import wait_live
from shared.policies import slots
from shared.policies.wan import LinkModel, Sent
from shared.runtime.timing import SPIN_S
from shared.wire import FIELD, LinkReport, Ping, SlotDone, SlotGrant, SlotRequest, Transfer, decode, encode, keys
from tests.e2e.serving import wait_until

# 80 kB/s: a 4,000-byte transfer takes 50 ms alone; 10 ms one-way latency
LINK = {"latency_ms": 10.0, "bandwidth_gbps": 0.00064, "tcp_window_mib": 64, "connections": 8}
ALONE_S = 4000 / 80_000
LATENCY_S = 0.010
#: Float tolerance on the policy's own (modelled) times: they are exact up to rounding.
EXACT = 1e-9


def settings(tmp_path: Path, url: str, sharing: str, mode: str = "model") -> Settings:
    path = tmp_path / "spec.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "datacenters": [{"name": "a", "gpus": 1}, {"name": "b", "gpus": 1}],
                "wan": {"sharing": sharing, "default": LINK, "mode": mode},
                "parallelism": {"pp": 2, "dp": 1},
            }
        )
    )
    return load_settings(path, env={"REDIS_URL": url, "BUBBLETEA_RUN": f"b-{sharing}"})


@dataclass
class Broker:
    settings: Settings
    links: dict[tuple[str, str], LinkDriver]  # the broker's own link drivers, to read their schedules


@pytest.fixture
async def broker(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Broker]:
    s = settings(tmp_path, redis_url, request.param)
    drivers: dict[tuple[str, str], LinkDriver] = {}

    def recording(*args: Any, **kw: Any) -> LinkDriver:
        driver = LinkDriver(*args, **kw)
        drivers[driver.src, driver.dst] = driver
        return driver

    monkeypatch.setattr(broker_module, "LinkDriver", recording)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(s, stop))
    r = Redis.from_url(redis_url, protocol=2)
    await wait_live(r, "wan_broker", timeout_s=30)  # the broker's first beat: it is ready
    await r.aclose()
    yield Broker(s, drivers)
    stop.set()
    await asyncio.wait_for(task, 30)


def transfer(i: int, prio: tuple[int, ...], src: str = "a", dst: str = "b", nbytes: int = 4000) -> Transfer:
    return Transfer(
        run="r",
        transfer_id=f"t{i}",
        src_dc=src,
        dst_dc=dst,
        nbytes=nbytes,
        priority=prio,
        deliver_to="inbox",
        payload=encode(Ping(seq=i, sent_ns=0)),
        sent_at=time.time(),
    )


async def arrivals(url: str, n: int) -> list[int]:
    """The seqs of the first `n` payloads delivered to the inbox, in the order they landed."""
    r = blocking_client(url)
    out: list[int] = []
    cursor = "0"
    while len(out) < n:
        reply: Any = await r.xread({"inbox": cursor}, block=30_000)
        assert reply, "deliveries stopped"
        for entry_id, fields in reply[0][1]:
            cursor = entry_id.decode()
            msg = decode(fields[FIELD])
            assert isinstance(msg, Ping)
            out.append(msg.seq)
    await r.aclose()
    return out


def assert_on_time(link: LinkDriver) -> None:
    """No delivery left before the arrival the policy modelled for it (causality: the emulated
    link never beats its model, however the host schedules the broker; how late deliveries are
    is bench/atlas.py's measurement, not a test's)."""
    assert link.late_ms and min(link.late_ms) >= -1e-6, min(link.late_ms)


def assert_fair_pair(first: Sent, second: Sent, latency_s: float = LATENCY_S) -> None:
    """Two 4,000-byte transfers under fair sharing on the 80 kB/s link: neither waits (each starts
    when submitted) and, while both are on the wire, they share it, so both finish by the time the
    link has carried the 8,000 bytes (the one that started `gap` earlier finishes `gap` earlier).
    Temporal sharing would finish the first at its start plus 50 ms instead."""
    assert first.started == first.submitted and second.started == second.submitted
    gap = second.started - first.started
    assert gap >= 0
    if gap < ALONE_S:  # the second started before the first was done: they shared the link
        want = (first.started + 2 * ALONE_S - gap, first.started + 2 * ALONE_S)
    else:  # the broker read the second only after the first was done: each ran alone
        want = (first.started + ALONE_S, second.started + ALONE_S)
    assert (first.tx_end, second.tx_end) == (pytest.approx(want[0], abs=EXACT), pytest.approx(want[1], abs=EXACT))
    for s in (first, second):
        assert s.arrival == pytest.approx(s.tx_end + latency_s, abs=EXACT)


@pytest.mark.parametrize("broker", ["temporal"], indirect=True)
async def test_temporal_sends_one_at_a_time_in_priority_order(broker: Broker, redis_url: str) -> None:
    async with Bus(redis_url) as bus:
        # the first request (sent 1 ms before the others) finds the link idle and starts at once
        # (a started transfer is never preempted); the next three queue behind it and leave by
        # priority, not by arrival
        first = msgspec.structs.replace(transfer(9, (9,)), sent_at=time.time() - 0.001)
        await bus.publish_many(
            keys.wan_stream(broker.settings.run),
            [first, transfer(0, (0, 2, 0)), transfer(1, (0, 0, 0)), transfer(2, (0, 1, 0))],
        )
        got = await arrivals(redis_url, 4)
    # Each arrives once. The order is the policy's schedule: the inbox shows it too, unless the
    # host stalled the broker past several arrival times, when their appends race each other.
    assert sorted(got) == [0, 1, 2, 9]
    link = broker.links["a", "b"]
    sent = sorted(link.delivered, key=lambda s: s.started)
    assert [s.id for s in sent] == ["t9", "t1", "t2", "t0"]
    assert sent[0].started == sent[0].submitted  # the link was idle
    for s in sent:  # each alone on the link: 50 ms sending, then 10 ms latency
        assert s.tx_end - s.started == pytest.approx(ALONE_S, abs=EXACT)
        assert s.arrival - s.tx_end == pytest.approx(LATENCY_S, abs=EXACT)
    for a, b in itertools.pairwise(sent):  # one at a time, back to back: the link never idles
        assert b.started == pytest.approx(max(a.tx_end, b.submitted), abs=EXACT)
    assert_on_time(link)


@pytest.mark.parametrize("broker", ["temporal"], indirect=True)
async def test_the_wire_starts_at_the_senders_send_time(broker: Broker, redis_url: str) -> None:
    """A transfer that reaches the broker 40 ms after its sender sent it (a slow bus hop, say) has
    been on the emulated wire for those 40 ms: it arrives 60 ms after it was sent, not after it
    was read."""
    link = broker.links["a", "b"]
    # The emulated wire has no past before the link's clock: send once 40 ms of it lie behind.
    await asyncio.sleep(max(0.0, link.sharing.now + 0.050 - link.now()))
    async with Bus(redis_url) as bus:
        late = msgspec.structs.replace(transfer(0, (0,)), sent_at=time.time() - 0.040)
        published = link.now()  # the broker reads it after this moment (on the link's clock)
        await bus.publish(keys.wan_stream(broker.settings.run), late)
        await arrivals(redis_url, 1)
    (sent,) = link.delivered
    # on the wire from its send time, 40 ms before the broker could have read it (not from then)
    assert sent.started <= published - 0.040 + 1e-6, (sent.started, published)
    assert sent.arrival - sent.started == pytest.approx(ALONE_S + LATENCY_S, abs=EXACT)
    assert_on_time(link)


async def test_transfers_read_apart_start_on_the_wire_when_they_were_sent(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas send at the same instant; the broker reads the first 1 ms later (a bus hop, a
    busy loop) and the second 1 ms after that. Both start on the emulated wire at their send time:
    had the first one's submission moved the link's clock to the present, the second would start
    over 1 ms late and, under fair sharing, the replicas would drift apart (live, 2-7 ms an
    iteration, where the simulator keeps them in lockstep).

    The policy's clock stays `settle` behind the present so that a transfer read up to that long
    after it was sent still starts at its send time (the next test pins the broker's settle). Here
    the link is slow and its settle long, 0.5 s, so that the reads, however a busy machine delays
    them, stay within it."""
    monkeypatch.setattr(links, "SETTLE_S", 0.5)
    model = LinkModel(bandwidth=80_000.0, latency=0.6, flow_cap=80_000.0)
    async with Bus(redis_url) as bus:
        driver = LinkDriver(bus, "a", "b", model, "fair")
        assert driver.settle == 0.5
        # The emulated wire has no past before the link's clock: send once 1 ms of it lies behind.
        await asyncio.sleep(max(0.0, driver.sharing.now + 0.002 - driver.now()))
        sent = time.time() - 0.001
        sent_by = driver.now() - 0.001  # `sent` on the link's clock, at the latest
        first = asyncio.create_task(driver.carry(msgspec.structs.replace(transfer(0, (0,)), sent_at=sent)))
        await asyncio.sleep(0.001)
        second = asyncio.create_task(driver.carry(msgspec.structs.replace(transfer(1, (1,)), sent_at=sent)))
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        await driver.close()
    a, b = sorted(driver.delivered, key=lambda s: s.started)
    assert {a.id, b.id} == {"t0", "t1"}
    assert b.started <= sent_by + 1e-6, (a.started, b.started, sent_by)  # neither started late
    assert_fair_pair(a, b, 0.6)  # 8,000 bytes at 80 kB/s: both sent 100 ms after they started, together
    assert_on_time(driver)


async def test_the_settle_leaves_every_delivery_the_lead_of_a_precise_sleep(redis_url: str) -> None:
    """A transfer's last byte is known `settle` after it left and arrives `latency` after: the
    settle is capped at the latency minus a precise sleep's lead, so no delivery is late by design."""
    async with Bus(redis_url) as bus:
        for latency, settle in ((0.040, SETTLE_S), (0.010, SETTLE_S), (0.004, 0.002), (0.002, 0.0), (0.0, 0.0)):
            model = LinkModel(bandwidth=80_000.0, latency=latency, flow_cap=80_000.0)
            driver = LinkDriver(bus, "a", "b", model, "fair")
            assert driver.settle == pytest.approx(settle), latency
            assert driver.settle <= max(0.0, latency - SPIN_S) + 1e-12
            await driver.close()


@pytest.mark.parametrize("broker", ["fair"], indirect=True)
async def test_fair_shares_the_link(broker: Broker, redis_url: str) -> None:
    async with Bus(redis_url) as bus:
        await bus.publish_many(keys.wan_stream(broker.settings.run), [transfer(0, (0,)), transfer(1, (1,))])
        got = await arrivals(redis_url, 2)
    assert sorted(got) == [0, 1]
    link = broker.links["a", "b"]
    a, b = sorted(link.delivered, key=lambda s: s.started)
    # both share 80 kB/s: each finishes sending at ~100 ms, arrives at ~110 ms, together (if the
    # broker reads the second a little after the first, the first runs alone at the full rate
    # meanwhile and finishes that much earlier), where temporal sharing would finish the first
    # 50 ms after it started
    assert_fair_pair(a, b)
    assert_on_time(link)


@pytest.mark.parametrize("broker", ["temporal"], indirect=True)
async def test_bad_requests_are_dead_lettered(broker: Broker, redis_url: str, redis: Redis) -> None:
    stream = keys.wan_stream(broker.settings.run)
    async with Bus(redis_url) as bus:
        await bus.publish(stream, transfer(0, (0,), src="a", dst="nowhere"))
        await bus.publish(stream, Ping(seq=1, sent_ns=0))
        await redis.xadd(stream, {FIELD: b"junk"})
        letters: list[str] = []
        cursor = "0"
        while len(letters) < 3:
            reply: Any = await redis.xread({keys.dead_letter_stream(stream): cursor}, block=30_000)
            assert reply
            for entry_id, fields in reply[0][1]:
                cursor = entry_id.decode()
                letters.append(fields[b"error"].decode())
    assert any("no WAN link a -> nowhere" in e for e in letters)
    assert any("got kind 'ping'" in e and "transfer" in e for e in letters)
    assert any("undecodable" in e for e in letters)


@pytest.mark.parametrize("broker", ["temporal"], indirect=True)
async def test_a_slot_request_to_a_model_mode_broker_is_dead_lettered_saying_why(
    broker: Broker, redis_url: str, redis: Redis
) -> None:
    """Slots are granted in the kernel and none modes only: a SlotRequest in model mode is refused."""
    stream = keys.wan_stream(broker.settings.run)
    req = SlotRequest(
        run="r", transfer_id="s0", src_dc="a", dst_dc="b", nbytes=10, priority=(0,), microbatch=0,
        what="act", reply_to="inbox",
    )  # fmt: skip
    async with Bus(redis_url) as bus:
        await bus.publish(stream, req)
    reply: Any = await redis.xread({keys.dead_letter_stream(stream): "0"}, block=30_000)
    assert reply, "nothing was dead-lettered"
    errors = [fields[b"error"].decode() for _, fields in reply[0][1]]
    assert any("wan.mode is 'model': a SlotRequest belongs to wan.mode kernel or none" in e for e in errors), errors


async def test_a_granting_broker_frees_a_slot_on_its_done_and_reclaims_one_never_done(
    tmp_path: Path, redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wan.mode none, temporal: one grant at a time; the receiver's SlotDone frees the link (its
    wire time is the link's busy time) and acks the request; a grant never reported done is
    reclaimed once stale, and the next transfer gets the link."""
    monkeypatch.setattr(slots, "STALE_FLOOR_S", 1.0)
    s = settings(tmp_path, redis_url, "temporal", mode="none")
    run, stream = s.run, keys.wan_stream(s.run)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(s, stop))
    await wait_live(redis, "wan_broker", timeout_s=30)
    cursor = "0"

    async def grants(wait_s: float) -> list[str]:
        nonlocal cursor
        reply: Any = await redis.xread({"inbox": cursor}, block=int(wait_s * 1000))
        out = []
        for entry_id, fields in reply[0][1] if reply else []:
            cursor = entry_id.decode()
            msg = decode(fields[FIELD])
            assert isinstance(msg, SlotGrant) and msg.why
            out.append(msg.transfer_id)
        return out

    def request(i: int) -> SlotRequest:
        return SlotRequest(
            run=run, transfer_id=f"s{i}", src_dc="a", dst_dc="b", nbytes=100, priority=(0, i, 0), microbatch=i,
            what="act", reply_to="inbox",
        )  # fmt: skip

    def done(i: int, seconds: float) -> SlotDone:
        return SlotDone(run=run, transfer_id=f"s{i}", src_dc="a", dst_dc="b", seconds=seconds)

    try:
        async with Bus(redis_url) as bus:
            await bus.publish(stream, request(0))
            await bus.publish(stream, request(1))
            assert await grants(30) == ["s0"]
            assert await grants(0.5) == [], "temporal granted a second transfer while the first was on the link"
            await bus.publish(stream, done(0, 0.25))
            assert await grants(30) == ["s1"]
            await bus.publish(stream, request(2))  # s1's receiver never reports: s1 goes stale
            t0 = time.monotonic()
            assert await grants(30) == ["s2"]
            assert time.monotonic() - t0 >= 0.5, "s2 was granted before s1 went stale"

            async def pending() -> int:
                info: Any = await redis.xpending(stream, "wan_broker")
                return int(info["pending"])

            async def only_s2_held() -> bool:  # s0 done, s1 reclaimed (acks are batched: polled)
                return await pending() == 1

            await wait_until(only_s2_held, "the requests of s0 (done) and s1 (reclaimed) acked")
            cur = "0"
            while True:
                reply: Any = await redis.xread({keys.events_stream(run): cur}, block=30_000)
                assert reply, "no link report"
                for entry_id, fields in reply[0][1]:
                    cur = entry_id.decode()
                    msg = decode(fields[FIELD])
                    if isinstance(msg, LinkReport) and msg.transfers == 1 and msg.in_flight == 1:
                        assert msg.bytes_sent == 100 and msg.busy_s == pytest.approx(0.25)
                        return
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
