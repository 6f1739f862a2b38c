"""The front door with a dispatcher per datacenter, against a real redis-server (or, under
``BUBBLETEA_TEST_REDIS=cluster``, a Redis Cluster: `make test` runs it on both): its routing read
(`services/prefill_queue/routing.py`: a snapshot that does not decode is not routed on, the others
still are), and over real HTTP a request's path through its datacenter's hash tag."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.prefill_queue.app import create_app
from services.prefill_queue.routing import DcRouting
from services.prefill_queue.state import SETTINGS
from shared.config.settings import Settings, load_settings
from shared.control import serving
from shared.policies.dc_routing import DcSnapshot, RouteWhy
from shared.policies.pipeline_plan import dispatch_dcs
from shared.policies.prefill_cost import PrefillCostModel
from shared.wire import FIELD, PrefillRequest, PrefillResult, decode, keys
from shared.wire.status import RequestStatus


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


# --- a front door with a dispatcher per datacenter, over real HTTP --------------------------------

RUN = "routed"


def per_dc_settings(url: str) -> Settings:
    s = load_settings(env={"REDIS_URL": url, "BUBBLETEA_RUN": RUN, "BUBBLETEA_DISPATCH": "per_dc"})
    prefill = msgspec.structs.replace(s.spec.prefill, max_queue_depth=2, max_prompt_tokens=64, request_timeout_s=60.0)
    return Settings(**{**s.__dict__, "spec": msgspec.structs.replace(s.spec, prefill=prefill)})


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(per_dc_settings(redis_url)))) as c:
        yield c


async def routed(redis: Redis, dcs: list[str]) -> list[tuple[str, PrefillRequest]]:
    """Every request on the datacenters' request streams, with the datacenter it is on."""
    out = []
    for dc in dcs:
        rows: Any = await redis.xrange(keys.prefill_requests_stream(RUN, dc))
        out += [(dc, decode(f[FIELD])) for _, f in rows]
    return [(dc, r) for dc, r in out if isinstance(r, PrefillRequest)]


def done(req: PrefillRequest) -> PrefillResult:
    return PrefillResult(id=req.id, status=RequestStatus.DONE, token=65, text="A", prompt_tokens=len(req.tokens))


async def test_a_request_routed_to_a_datacenter_is_kept_answered_and_found_under_its_tag(
    client: TestClient, redis: Redis
) -> None:
    """docs/architecture.md, "Keys by hash tag": the request is accepted in its datacenter's tag, its
    answer comes back on the front door's results stream in that tag (its own consumer), and a GET
    that names no datacenter finds it; a client's key, claimed in the run's tag, gives the same
    request however often it is sent."""
    dcs = dispatch_dcs(client.server.app[SETTINGS].spec)
    assert len(dcs) == 2
    r1 = await client.post("/v1/prefill", json={"prompt": [1, 2, 3]}, headers={"Idempotency-Key": "k1"})
    assert r1.status == 202
    rid = (await r1.json())["id"]
    for _ in range(2):  # a retry, whichever datacenter it would be routed to now
        again = await client.post("/v1/prefill", json={"prompt": [1, 2, 3]}, headers={"Idempotency-Key": "k1"})
        assert again.status == 200 and (await again.json())["id"] == rid
    [(dc, req)] = await routed(redis, dcs)  # enqueued once
    assert req.id == rid and keys.hash_tag(req.reply_to) == f"{RUN}:{dc}"
    assert keys.hash_tag(keys.idempotency_key(RUN, "k1")) == RUN
    assert (await (await client.get(f"/v1/prefill/{rid}")).json())["status"] == "queued"
    assert await serving.inflight(redis, RUN, dcs) == 1
    assert await serving.answer(redis, RUN, done(req), req.reply_to, dc)
    got = await (await client.get(f"/v1/prefill/{rid}")).json()
    assert got["status"] == "done" and got["result"]["token"] == 65
    assert 0 < await redis.ttl(keys.prefill_request_key(RUN, rid, dc)) <= keys.PREFILL_READ_GRACE_S
    assert await serving.inflight(redis, RUN, dcs) == 0
    # a synchronous request: answered on the datacenter's results stream, read by that stream's consumer
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}))
    for _ in range(300):
        waiting = [(d, r) for d, r in await routed(redis, dcs) if r.id != rid]
        if waiting:
            break
        await asyncio.sleep(0.1)
    [(dc2, sync)] = waiting
    assert await serving.answer(redis, RUN, done(sync), sync.reply_to, dc2)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "A"


async def test_a_claimed_key_whose_request_was_never_enqueued_is_enqueued_by_the_retry(
    client: TestClient, redis: Redis
) -> None:
    """A front door that died between claiming a client's key and enqueueing its request: the
    client's retry enqueues the claimed request (its id, its datacenter), once."""
    dcs = dispatch_dcs(client.server.app[SETTINGS].spec)
    assert await serving.claim_idempotency(redis, RUN, "k2", dcs[1], "pf-claimed") is None
    resp = await client.post("/v1/prefill", json={"prompt": [4, 5]}, headers={"Idempotency-Key": "k2"})
    assert resp.status == 200 and (await resp.json())["id"] == "pf-claimed"
    [(dc, req)] = await routed(redis, dcs)
    assert (dc, req.id, keys.hash_tag(req.reply_to)) == (dcs[1], "pf-claimed", f"{RUN}:{dcs[1]}")
    again = await client.post("/v1/prefill", json={"prompt": [4, 5]}, headers={"Idempotency-Key": "k2"})
    assert (await again.json())["id"] == "pf-claimed" and len(await routed(redis, dcs)) == 1


async def test_a_datacenter_s_full_queue_refuses_the_request_routed_there(client: TestClient, redis: Redis) -> None:
    """docs/config.md: `prefill.max_queue_depth` bounds each dispatcher's queue. A request routed to
    a full datacenter gets its 429 (the client's retry is routed again), not another's queue."""
    dcs = dispatch_dcs(client.server.app[SETTINGS].spec)
    await redis.set(keys.prefill_inflight_key(RUN, dcs[0]), 2)  # full; before any snapshot, dcs[0] comes first
    resp = await client.post("/v1/prefill", json={"prompt": [1]})
    assert resp.status == 429 and "queue is full" in (await resp.json())["error"]["message"]
    assert await routed(redis, dcs) == []
    resp = await client.post("/v1/prefill", json={"prompt": [1]})  # the next in turn: dcs[1], not full
    assert resp.status == 202 and [dc for dc, _ in await routed(redis, dcs)] == [dcs[1]]


async def test_a_key_used_under_one_dispatcher_is_refused_with_409(client: TestClient, redis: Redis) -> None:
    """A client's key whose value is a plain request id (written while the run had one dispatcher,
    before it was restarted with one per datacenter) is no claim: a 409 that says so, nothing queued."""
    dcs = dispatch_dcs(client.server.app[SETTINGS].spec)
    await redis.set(keys.idempotency_key(RUN, "old"), "pf-from-one-dispatcher", ex=60)
    resp = await client.post("/v1/prefill", json={"prompt": [1]}, headers={"Idempotency-Key": "old"})
    body = await resp.json()
    assert resp.status == 409 and "not a claim" in body["error"]["message"], body
    assert await routed(redis, dcs) == []
