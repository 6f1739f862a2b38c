"""The front door's routing read (`services/prefill_queue/routing.py`) against a real redis-server:
a datacenter's snapshot that does not decode is not routed on, and the others still are."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis

from services.prefill_queue.routing import DcRouting
from shared.policies.dc_routing import DcSnapshot, RouteWhy
from shared.policies.prefill_cost import PrefillCostModel
from shared.wire import PrefillRequest, keys


async def test_an_unreadable_snapshot_is_skipped_and_the_readable_datacenter_takes_the_request(redis: Redis) -> None:
    run, now = f"route-{time.time_ns()}", time.time()
    good = DcSnapshot(dc="dc-b", ready=True, ahead_s=5.0, rate=1.0, at=now)
    await redis.set(keys.dc_snapshot_key(run, "dc-a"), b"{not json")
    await redis.set(keys.dc_snapshot_key(run, "dc-b"), msgspec.json.encode(good))
    routing = DcRouting(run, ["dc-a", "dc-b"], PrefillCostModel())
    await routing.read(redis)
    await routing.read(redis)  # read again: still unreadable, logged once
    assert [s.dc for s in routing.router.view(now)] == ["dc-b"]
    req = PrefillRequest(id="q", model="m", tokens=(1, 2, 3), submitted=now, deadline=now + 30, reply_to="x")
    dc, route = routing.place(req, now=now)
    assert (dc, route.why) == ("dc-b", RouteWhy.SOONEST)  # dc-a, empty but unreadable, is not chosen
    assert routing._unreadable == {"dc-a"}
