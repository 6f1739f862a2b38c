"""Serving readiness end to end over real Redis and real HTTP: the dispatcher judges it from the
run's slot leases (taken and ended by the workers' own lease code), the front door answers /ready
and refuses new requests with it at once, and queued requests are failed explicitly when the run
finishes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.dispatcher.serve import serve
from services.prefill_queue.app import create_app
from services.stage_worker.membership.generations import Generations
from services.stage_worker.membership.lease import SlotLease
from shared.bus import Bus
from shared.config.settings import Settings, load_settings
from shared.wire import BubbleEnd, BubbleStart, keys

RUN = "ready-test"


async def wait_ready_state(
    client: TestClient, state: str, timeout_s: float = 60.0, *, saying: str = ""
) -> tuple[int, dict[str, Any]]:
    """Poll /ready until it says `state` (with `saying` in its reason)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = await client.get("/ready")
        body = await resp.json()
        if body.get("state") == state and saying in body.get("reason", ""):
            return resp.status, {**body, "retry_after": resp.headers.get("Retry-After")}
        assert time.monotonic() < deadline, f"/ready never said {state!r}; last: {body}"
        await asyncio.sleep(0.05)


@pytest.fixture
def settings(redis_url: str) -> Settings:
    s = load_settings(None)
    # No bubble is ever announced here: a run whose slots are all held counts as serving for
    # `unready_after_s` without one, then as stalled. Long, so a busy machine's slow steps never
    # turn it stalled before the run finishes.
    bt = msgspec.structs.replace(s.spec.bubbletea, unready_after_s=3600.0)
    return dataclasses.replace(s, redis_url=redis_url, run=RUN, spec=msgspec.structs.replace(s.spec, bubbletea=bt))


@pytest.fixture
async def dispatcher(settings: Settings) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    yield
    stop.set()
    await asyncio.wait_for(task, 30)


async def test_ready_follows_the_run_and_queued_requests_fail_when_it_finishes(
    settings: Settings, dispatcher: None, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test's workers renew their leases every 0.5 s; a lease outlives a stall of the test's
    # process of a minute, not 3 s (a lost lease would be a lost worker: not what this is about).
    monkeypatch.setattr(keys, "LEASE_TTL_MS", 60_000)
    p = settings.spec.parallelism
    async with TestClient(TestServer(create_app(settings))) as client:
        # no worker yet: not ready, and a new request is refused at once with the reason
        status, body = await wait_ready_state(client, "starting")
        assert status == 503 and "has not started: 0 of 4 slots held" in body["reason"] and body["retry_after"] == "2"
        # refused, not queued to wait for its timeout (that would answer 504, and queue it)
        resp = await client.post("/v1/completions", json={"model": "bubbletea-gpt", "prompt": "hi"})
        assert resp.status == 503 and resp.headers["Retry-After"] == "2"
        error = (await resp.json())["error"]
        assert error["type"] == "service_unavailable" and "has not started" in error["message"]
        assert await redis.xlen(keys.prefill_requests_stream(RUN)) == 0  # nothing was queued

        # the workers take every slot, then set up: joining until they join the run; a request
        # is taken now and waits for the first bubbles
        leases = [SlotLease(redis, RUN, p.pp, p.dp, holder=f"w{i}") for i in range(p.pp * p.dp)]
        slots = [await lease.acquire() for lease in leases]

        async def renew() -> None:
            while True:
                await asyncio.sleep(0.5)
                for lease in leases:
                    await lease.renew()

        renewing = asyncio.create_task(renew())
        try:
            setting_up = "starts once its workers have set up (4 slots held)"
            status, body = await wait_ready_state(client, "joining", saying=setting_up)
            assert status == 200 and body["status"] == "ready"
            resp = await client.post("/v1/prefill", json={"prompt": "queued while its workers set up"})
            assert resp.status == 202
            early = (await resp.json())["id"]
            # every worker joins the run's generation (its model built): serving (before the first
            # bubble, which would come within it)
            gens = [Generations(redis, RUN, leases[0].all_slots) for _ in leases]
            await asyncio.gather(*(g.enter(after_loss=False) for g in gens))
            await asyncio.gather(*(g.barrier(slot, timeout_s=60) for g, slot in zip(gens, slots, strict=True)))
            status, body = await wait_ready_state(client, "serving")
            assert status == 200 and body["status"] == "ready" and body["run"] == RUN
            resp = await client.post("/v1/prefill", json={"prompt": "queued while serving"})
            assert resp.status == 202
            rid = (await resp.json())["id"]
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing

        # the run finishes (each worker marks its slot done): the queued request fails because of
        # that, saying so (not at its deadline, which would fail it with reason "deadline")
        for lease in leases:
            await lease.finish()
        deadline = time.monotonic() + 60
        while (answer := await (await client.get(f"/v1/prefill/{rid}")).json())["status"] == "queued":
            assert time.monotonic() < deadline, "the queued request was not failed"
            await asyncio.sleep(0.05)
        assert answer["status"] == "failed" and answer["reason"] == "unavailable"
        assert "training finished" in answer["error"]
        # the one taken while the workers set up waited as long, and is failed the same way
        answer = await (await client.get(f"/v1/prefill/{early}")).json()
        assert answer["status"] == "failed" and answer["reason"] == "unavailable"
        status, body = await wait_ready_state(client, "finished")
        assert status == 503 and body["retry_after"] == "60"
        resp = await client.post("/v1/prefill", json={"prompt": "too late"})
        assert resp.status == 503 and "training finished" in (await resp.json())["error"]["message"]


async def test_with_a_ttft_objective_a_run_whose_workers_set_up_is_not_ready_and_refuses_at_once(
    settings: Settings, dispatcher: None, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front door stating a TTFT objective (as `up` and compose do) and no decoder: while the
    run's workers set up, nothing says when the first bubble comes, so /ready says 503 (a probe
    sends traffic once it would be served) and a request is refused at once with a 429 saying why,
    not left to fail at its objective."""
    monkeypatch.setattr(keys, "LEASE_TTL_MS", 60_000)
    p = settings.spec.parallelism
    prefill = msgspec.structs.replace(settings.spec.prefill, ttft_objective_ms=500.0)
    with_objective = dataclasses.replace(settings, spec=msgspec.structs.replace(settings.spec, prefill=prefill))
    leases = [SlotLease(redis, RUN, p.pp, p.dp, holder=f"w{i}") for i in range(p.pp * p.dp)]
    for lease in leases:
        await lease.acquire()
    async with TestClient(TestServer(create_app(with_objective))) as client:
        status, body = await wait_ready_state(client, "joining")
        assert status == 503 and body["retry_after"] == "1"
        assert body["status"] == "not ready" and "a request with a TTFT objective is refused" in body["reason"]
        resp = await client.post("/v1/completions", json={"model": "bubbletea-gpt", "prompt": "now", "max_tokens": 1})
        assert resp.status == 429 and "Retry-After" in resp.headers
        assert "no bubble yet" in (await resp.json())["error"]["message"]


async def test_with_a_ttft_objective_the_front_door_is_ready_once_the_pipeline_came_round(
    settings: Settings, dispatcher: None, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training runs, but until every worker has come round to its first bubble's point in a later
    iteration nothing says how fast the bubbles serve: /ready says 503 and a request with the
    objective is refused at once (429) saying so; once they have, /ready says 200."""
    monkeypatch.setattr(keys, "LEASE_TTL_MS", 60_000)
    p = settings.spec.parallelism
    prefill = msgspec.structs.replace(settings.spec.prefill, ttft_objective_ms=500.0)
    with_objective = dataclasses.replace(settings, spec=msgspec.structs.replace(settings.spec, prefill=prefill))
    leases = [SlotLease(redis, RUN, p.pp, p.dp, holder=f"w{i}") for i in range(p.pp * p.dp)]
    slots = [await lease.acquire() for lease in leases]
    gens = [Generations(redis, RUN, leases[0].all_slots) for _ in leases]
    await asyncio.gather(*(g.enter(after_loss=False) for g in gens))
    await asyncio.gather(*(g.barrier(slot, timeout_s=60) for g, slot in zip(gens, slots, strict=True)))
    workers = [f"r{r}s{st}" for r in range(p.dp) for st in range(p.pp)]

    async def bubbles(bus: Bus, iteration: int) -> None:
        for name in workers:
            replica, stage = int(name[1]), int(name[3])
            at = time.time()
            common = dict(run=RUN, worker=name, replica=replica, stage=stage, iteration=iteration, position=2)
            await bus.publish(keys.bubbles_stream(RUN), BubbleStart(
                **common, dc="dc-a", predicted_ms=20.0, free_memory_bytes=1 << 30, at=at,
            ))  # fmt: skip
            await bus.publish(keys.bubbles_stream(RUN), BubbleEnd(
                **common, predicted_ms=20.0, actual_ms=20.0, at=at + 0.02,
            ))  # fmt: skip

    completion = {"model": "bubbletea-gpt", "prompt": "now", "max_tokens": 1}
    async with TestClient(TestServer(create_app(with_objective))) as client, Bus(settings.redis_url, name="t") as bus:
        await bubbles(bus, 0)
        status, body = await wait_ready_state(client, "serving", saying="come round once")
        assert status == 503 and body["retry_after"] == "1"
        resp = await client.post("/v1/completions", json=completion)
        assert resp.status == 429 and "Retry-After" in resp.headers
        assert "has not come round once" in (await resp.json())["error"]["message"]
        await asyncio.sleep(0.1)
        await bubbles(bus, 1)  # every worker at position 2 again, an iteration on
        deadline = time.monotonic() + 30
        while (resp := await client.get("/ready")).status != 200:
            assert time.monotonic() < deadline, f"never ready: {await resp.json()}"
            await asyncio.sleep(0.05)
        assert (await resp.json())["state"] == "serving"
    for lease in leases:
        await lease.finish()


async def test_no_dispatcher_means_not_ready_but_requests_are_accepted(settings: Settings, redis: Redis) -> None:
    """A dispatcher that restarts costs latency, not answers: without one, requests wait for it."""
    async with TestClient(TestServer(create_app(settings))) as client:
        resp = await client.get("/ready")
        body = await resp.json()
        assert resp.status == 503 and body["state"] == "no_dispatcher" and "no dispatcher" in body["reason"]
        assert (await client.post("/v1/prefill", json={"prompt": "waits"})).status == 202
        assert await redis.xlen(keys.prefill_requests_stream(RUN)) == 1
