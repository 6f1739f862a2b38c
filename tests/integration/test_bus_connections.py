"""Our Redis clients never swallow a cancellation, nor ride an outage out once told to stop (bus/connection.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.bus import Bus
from shared.bus.connection import TRANSIENT_ERRORS, blocking_client, command_client
from shared.runtime.redis_server import free_port
from shared.wire import Ping


@pytest.mark.parametrize("make", [command_client, blocking_client])
async def test_cancelling_a_busy_client_always_cancels(redis_url: str, make: object) -> None:
    r = make(redis_url)  # type: ignore[operator]
    await r.ping()
    swallowed = 0
    for i in range(200):

        async def busy() -> None:
            for _ in range(10_000):
                await r.set("k", "v")

        task = asyncio.create_task(busy())
        for _ in range(i % 7):  # cancel at varying points of the command cycle
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
            swallowed += 1
        except asyncio.CancelledError:
            pass
    await r.aclose()
    assert swallowed == 0, f"{swallowed} of 200 cancellations were swallowed"


async def test_a_stopping_bus_gives_up_an_outage_at_once() -> None:
    """A publish rides a Redis outage out for RIDE_OUT_S (30 s), but not once its process is
    stopping (`Bus(stop=...)`): a dispatcher whose Redis died with its launcher outlived it by more
    than 30 s, retrying a write nobody would read (a CI run, 2026-11-29)."""
    stop = asyncio.Event()
    bus = Bus(f"redis://127.0.0.1:{free_port()}", stop=stop)  # nothing listens: every connect is refused
    t0 = time.monotonic()
    publish = asyncio.create_task(bus.publish("s", Ping(seq=1, sent_ns=0)))
    await asyncio.sleep(0.3)  # riding it out
    assert not publish.done(), "gave up before it was asked to stop"
    stop.set()
    with pytest.raises(TRANSIENT_ERRORS):
        await asyncio.wait_for(publish, timeout=5)  # RIDE_OUT_S is 30
    assert time.monotonic() - t0 < 5
    await bus.aclose()
