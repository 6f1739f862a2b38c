"""`bubbletea demo`: the main job.

Start the bus (embedded Redis unless REDIS_URL is set) and the front door, show they are healthy
and that a message makes a round trip over the bus, then train the demo model over live services
(the WAN broker and one stage worker per pipeline slot) and print its loss and iteration times,
then stop everything cleanly. Prefill in the bubbles joins as the serving plane is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time

from shared import keys
from shared.bus import Bus, Delivery
from shared.health import live_instances, wait_live
from shared.launcher.procs import Proc, spawn, stop_all, wait_http_healthy
from shared.launcher.services import PREFILL_QUEUE
from shared.launcher.train import run_training
from shared.logs import get_logger
from shared.redis_server import EmbeddedRedis, free_port
from shared.settings import Settings
from shared.wire import Ping

log = get_logger(__name__)


def say(text: str) -> None:
    print(text, flush=True)


async def run_demo(settings: Settings, *, hold: bool = False) -> int:
    embedded: EmbeddedRedis | None = None
    procs: list[Proc] = []
    try:
        if settings.redis_url:
            url = settings.redis_url
            say(f"==> using Redis at {url} (REDIS_URL)")
        else:
            embedded = EmbeddedRedis().start()
            url = embedded.url
            assert embedded.proc is not None
            say(f"==> started embedded Redis at {url} ({embedded.binary}, pid={embedded.proc.pid})")
        # The front door runs for the whole demo; the broker and workers belong to the training run.
        for svc in (PREFILL_QUEUE,):
            env = {
                "REDIS_URL": url,
                "BUBBLETEA_CONFIG": str(settings.spec_path),
                "BUBBLETEA_LOG_LEVEL": settings.log_level,
            }
            port = None
            if svc.http:
                port = free_port()
                env["BUBBLETEA_HTTP_PORT"] = str(port)
                env["BUBBLETEA_HTTP_HOST"] = "127.0.0.1"
            p = await spawn(svc, env)
            procs.append(p)
            if port is not None:
                await wait_http_healthy(p, f"http://127.0.0.1:{port}")
            say(f"==> {svc.name} is healthy" + (f" at {p.url}" if p.url else "") + f" (pid={p.proc.pid})")
        async with Bus(url, settings.spec.bus, name="demo") as bus:
            rtt_ms = await _bus_round_trip(bus)
            say(f"==> bus round trip (publish -> Redis -> consumer handler, first message): {rtt_ms:.2f} ms")
            try:
                await wait_live(bus.redis, PREFILL_QUEUE.name, timeout_s=10)
            except TimeoutError:
                print(f"warning: no heartbeat from {PREFILL_QUEUE.name}", file=sys.stderr)
            live = await live_instances(bus.redis)
        say("")
        say(f"{'service':<16}{'instance':<28}{'health':<10}")
        for inst in live:
            say(f"{inst['service']:<16}{inst['instance']:<28}{'ok':<10}")
        say("")
        spec = settings.spec
        run = dataclasses.replace(settings, run=f"demo-{os.getpid()}")
        say(
            f"==> training over live services: wan_broker + {spec.parallelism.pp * spec.parallelism.dp} stage workers "
            f"(PP={spec.parallelism.pp} x DP={spec.parallelism.dp}, {spec.training.schedule}, "
            f"WAN sharing {spec.wan.sharing}, {spec.training.iterations} iterations)"
        )
        result = await run_training(run, url, progress=True, quiet=True)
        say(
            f"==> trained: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
            f"steady iteration time {result.steady_iteration_s() * 1000:.1f} ms"
        )
        say("")
        if hold:
            say("==> every service is healthy; press Ctrl-C to stop")
            await _until_a_service_dies(procs)
            return 1
        say("==> every service is healthy; stopping")
        return 0
    finally:
        codes = await stop_all(procs)
        for name, code in codes.items():
            if code not in (0, None):
                say(f"==> {name} exited with code {code}")
        if embedded is not None:
            embedded.stop()
        say("==> stopped cleanly" if all(c == 0 for c in codes.values()) else "==> stopped (with errors)")


async def _until_a_service_dies(procs: list[Proc]) -> None:
    """Block until Ctrl-C (cancellation) or until a service exits on its own (then say which)."""
    waits = {asyncio.create_task(p.proc.wait()): p for p in procs}
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in waits:
            t.cancel()
    for t in done:
        p = waits[t]
        say(f"==> {p.name} exited on its own with code {p.proc.returncode}; stopping the rest")


async def _bus_round_trip(bus: Bus) -> float:
    got = asyncio.Event()

    async def handler(_: Delivery) -> None:
        got.set()

    group = f"demo-{os.getpid()}"
    async with bus.consumer(keys.PING_STREAM, group, handler):
        t0 = time.perf_counter()
        await bus.publish(keys.PING_STREAM, Ping(seq=0, sent_ns=time.perf_counter_ns()))
        await asyncio.wait_for(got.wait(), 10)
        elapsed = (time.perf_counter() - t0) * 1000
    with contextlib.suppress(Exception):
        await bus.redis.xgroup_destroy(keys.PING_STREAM, group)
    return elapsed
