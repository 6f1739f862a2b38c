"""The dispatcher's handlers refuse what does not belong on their streams (the bus then
dead-letters it, keeping the payload), and an expired request is failed explicitly."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.dispatcher.dispatcher import Dispatcher
from shared import serving
from shared.bus import Bus, Delivery, Reject
from shared.config import BusConfig
from shared.settings import load_settings
from shared.wire import Ping, PrefillRequest, PrefillResult

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("handler", ["on_request", "on_bubble", "on_report"])
async def test_a_message_of_the_wrong_kind_is_rejected_naming_it(redis_url: str, handler: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, "run")
        with pytest.raises(Reject, match="got Ping"):
            await getattr(d, handler)(Delivery("1-0", "s", Ping(seq=1, sent_ns=0), 1))


async def test_a_request_whose_deadline_passes_in_the_queue_fails_explicitly(redis_url: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, "run")
        now = time.time()
        req = PrefillRequest(
            id="late", model="m", tokens=(1, 2), submitted=now, deadline=now + 0.05, reply_to="bt:test:results"
        )
        assert await serving.accept(bus.redis, req, 10)
        handled = d.on_request(Delivery("1-0", "s", req, 1))  # held until answered or failed
        task = asyncio.create_task(handled)
        await asyncio.sleep(0.1)  # no bubble ever opens: past the deadline
        await d.tick()
        await asyncio.wait_for(task, 5)  # released: the delivery can be acked
        got = await serving.lookup(bus.redis, "late")
        assert isinstance(got, PrefillResult) and not got.ok and "deadline passed" in got.error
        assert await serving.inflight(bus.redis) == 0
