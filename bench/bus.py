"""Bus benchmark: raw pipelined XADD vs the bus's publish-consume-ack, and request/reply round trips.

All are measured in one run against the same private redis-server, so the ratio is fair:

* `redis_raw_xadd_per_s`: pipelined XADD, the ceiling for any publisher;
* `bus_msgs_per_s`: published (pipelined), consumed by a group consumer, handled and acked;
* `roundtrip_*`: publish -> Redis -> a blocked consumer in the same process runs its handler;
* `request_reply_*`: Ping to an echo service in another process, Pong back (two bus hops).
Prints a human summary, then one JSON object on the last line.

    python bench/bus.py            # full run (~1 min)
    python bench/bus.py --quick    # under 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import uvloop
from redis.asyncio import Redis

from shared.bus import Bus, Delivery
from shared.config.spec import BusConfig
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import FIELD, Message, Ping, Pong, encode, keys

PIPELINE = 500  # XADDs per round trip for both publishers: the same batching on both sides


async def raw_xadd(r: Redis, n: int) -> float:
    """Messages/s that Redis accepts from a pipelined XADD loop: the ceiling for any publisher."""
    payload = encode(Ping(seq=0, sent_ns=0))
    t0 = time.perf_counter()
    for start in range(0, n, PIPELINE):
        async with r.pipeline(transaction=False) as p:
            for _ in range(min(PIPELINE, n - start)):
                p.xadd("bench:raw", {FIELD: payload})
            await p.execute()
    return n / (time.perf_counter() - t0)


async def bus_throughput(bus: Bus, n: int) -> float:
    """Messages/s published, consumed by a group consumer, handled and acked (end to end)."""
    handled = 0
    done = asyncio.Event()

    async def handler(_: Delivery) -> None:
        nonlocal handled
        handled += 1
        if handled == n:
            done.set()

    consumer = await bus.consumer("bench:tput", "bench", {Ping: handler}, config=BusConfig(concurrency=512)).start()
    t0 = time.perf_counter()
    for start in range(0, n, PIPELINE):
        batch = (Ping(seq=i, sent_ns=0) for i in range(start, min(n, start + PIPELINE)))
        await bus.publish_many("bench:tput", batch)
    await asyncio.wait_for(done.wait(), 120)
    await consumer.stop()  # returns once the last ack has landed: count that time too
    elapsed = time.perf_counter() - t0
    assert (await bus.redis.xpending("bench:tput", "bench"))["pending"] == 0
    return n / elapsed


async def echo_service(url: str, ready: Any, stop: Any) -> None:
    """The far end of the round trip, as its own process (like a real service): Ping -> Pong."""
    async with Bus(url) as bus:

        async def echo(d: Delivery) -> None:
            m = d.message
            assert isinstance(m, Ping)
            await bus.publish(keys.PONG_STREAM, Pong(seq=m.seq, sent_ns=m.sent_ns))

        async with bus.consumer(keys.PING_STREAM, "bench-echo", {Ping: echo}):
            ready.set()
            await asyncio.to_thread(stop.wait)


def run_echo_service(url: str, ready: Any, stop: Any) -> None:
    uvloop.run(echo_service(url, ready, stop))


async def roundtrips(bus: Bus, n: int) -> list[float]:
    """One trip out to Redis and back: publish -> blocked consumer (same process) -> handler runs."""
    waiters: dict[int, asyncio.Future[None]] = {}

    async def handler(d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        fut = waiters.pop(d.message.seq, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    return await _timed_pings(bus, "bench:rtt", handler, waiters, n)


async def _timed_pings(
    bus: Bus,
    stream: str,
    handler: Any,
    waiters: dict[int, asyncio.Future[None]],
    n: int,
    reply_stream: str | None = None,
    reply_kind: type[Message] = Ping,
) -> list[float]:
    lat: list[float] = []
    loop = asyncio.get_running_loop()
    async with bus.consumer(reply_stream or stream, "bench-client", {reply_kind: handler}):
        for i in range(n + 50):  # the first 50 warm up connections and are not counted
            fut = loop.create_future()
            waiters[i] = fut
            t0 = time.perf_counter_ns()
            await bus.publish(stream, Ping(seq=i, sent_ns=t0))
            await asyncio.wait_for(fut, 5)
            if i >= 50:
                lat.append((time.perf_counter_ns() - t0) / 1e6)
    return lat


async def request_reply(bus: Bus, n: int) -> list[float]:
    """Request/reply between two processes over the bus: Ping -> echo service -> Pong -> here."""
    waiters: dict[int, asyncio.Future[None]] = {}

    async def on_pong(d: Delivery) -> None:
        assert isinstance(d.message, Pong)
        fut = waiters.pop(d.message.seq, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    echo = ctx.Process(target=run_echo_service, args=(bus.url, ready, stop), daemon=True)
    echo.start()
    try:
        if not await asyncio.to_thread(ready.wait, 60):
            raise RuntimeError("echo service did not start")
        lat = await _timed_pings(
            bus, keys.PING_STREAM, on_pong, waiters, n, reply_stream=keys.PONG_STREAM, reply_kind=Pong
        )
    finally:
        stop.set()
        await asyncio.to_thread(echo.join, 10)
    return lat


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000, method="inclusive")[int(q * 10) - 1]


async def main(quick: bool) -> dict[str, float]:
    n_tput = 20_000 if quick else 100_000
    n_rtt = 1_000 if quick else 5_000
    async with EmbeddedRedis() as server, Bus(server.url) as bus:
        raw = await raw_xadd(bus.redis, n_tput)
        tput = await bus_throughput(bus, n_tput)
        lat = await roundtrips(bus, n_rtt)
        rr = await request_reply(bus, n_rtt)
    result = {
        "bus_msgs_per_s": round(tput),
        "redis_raw_xadd_per_s": round(raw),
        "ratio": round(tput / raw, 3),
        "roundtrip_p50_ms": round(statistics.median(lat), 3),
        "roundtrip_p99_ms": round(pct(lat, 99), 3),
        "request_reply_p50_ms": round(statistics.median(rr), 3),
        "request_reply_p99_ms": round(pct(rr, 99), 3),
        "messages": n_tput,
        "roundtrips": n_rtt,
    }
    print(f"raw pipelined XADD:          {raw:10.0f} msg/s", file=sys.stderr)
    print(f"bus publish+consume+ack:     {tput:10.0f} msg/s  ({tput / raw:.0%} of raw XADD)", file=sys.stderr)
    print(
        f"round trip (publish->handler): p50 {result['roundtrip_p50_ms']} ms, p99 {result['roundtrip_p99_ms']} ms",
        file=sys.stderr,
    )
    print(
        f"request/reply, 2 processes:  p50 {result['request_reply_p50_ms']} ms, "
        f"p99 {result['request_reply_p99_ms']} ms",
        file=sys.stderr,
    )
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller run, finishes in under 30 s")
    args = ap.parse_args()
    print(json.dumps(uvloop.run(main(args.quick))))
