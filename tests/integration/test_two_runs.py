"""Two runs on one Redis share no request stream, no consumer group, no admission count, no
idempotency key and no readiness (issue 62; issue 66 found `bt:prefill:requests` and
`bt:prefill:inflight` global): one run's full queue does not refuse another's requests, a client's
idempotency key is its run's, a run's dispatcher reads, holds and reconciles only its own run's,
and a run's front door is gated by its own run's dispatchers and decoders alone. A real
redis-server, the real front doors and a real dispatcher (`services.dispatcher.serve`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.dispatcher.dispatcher import SERVICE
from services.dispatcher.serve import serve
from services.prefill_queue.api import read_decoders, read_gate
from services.prefill_queue.app import create_app
from services.prefill_queue.state import GATE
from shared.config.settings import Settings, load_settings
from shared.control import serving, verdicts
from shared.control.health import Heartbeat
from shared.wire import PrefillRequest, keys
from shared.wire.status import RequestStatus, ServingState

A, B = "run-a", "run-b"
DEPTH = 2  # prefill.max_queue_depth of each run


def settings_for(redis_url: str, run: str) -> Settings:
    s = load_settings(None)
    # No worker ever joins: the dispatcher stays STARTING, which keeps what is queued.
    bt = msgspec.structs.replace(s.spec.bubbletea, unready_after_s=3600.0)
    prefill = msgspec.structs.replace(s.spec.prefill, max_queue_depth=DEPTH)
    spec = msgspec.structs.replace(s.spec, bubbletea=bt, prefill=prefill)
    return dataclasses.replace(s, redis_url=redis_url, run=run, spec=spec)


def request(run: str, rid: str) -> PrefillRequest:
    """A request of `run`, answered on a front door's results stream of that run (a dispatcher
    dead-letters one answered outside its run)."""
    reply_to = keys.prefill_results_stream(run, "front")
    return PrefillRequest(id=rid, model="m", tokens=(1, 2, 3), submitted=time.time(), reply_to=reply_to)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    """Poll stored state (Redis has no event for a group's progress) until `check` holds."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.02)


async def test_one_runs_full_queue_does_not_refuse_another_runs_requests(redis_url: str, redis: Redis) -> None:
    """Run A's front door at its `max_queue_depth` answers 429; run B's, on the same Redis, still
    accepts its own, onto its own stream."""
    async with (
        TestClient(TestServer(create_app(settings_for(redis_url, A)))) as door_a,
        TestClient(TestServer(create_app(settings_for(redis_url, B)))) as door_b,
    ):
        for _ in range(DEPTH):
            assert (await door_a.post("/v1/prefill", json={"prompt": [1, 2, 3]})).status == 202
        assert (await door_a.post("/v1/prefill", json={"prompt": [1, 2, 3]})).status == 429  # A is full
        for _ in range(DEPTH):
            resp = await door_b.post("/v1/prefill", json={"prompt": [1, 2, 3]})
            assert resp.status == 202, await resp.text()  # B is not
        assert (await door_b.post("/v1/prefill", json={"prompt": [1, 2, 3]})).status == 429  # at its own depth
    assert [await serving.inflight(redis, run) for run in (A, B)] == [DEPTH, DEPTH]
    for run in (A, B):
        assert await redis.xlen(keys.prefill_requests_stream(run)) == DEPTH


async def test_a_clients_idempotency_key_is_its_runs(redis_url: str, redis: Redis) -> None:
    """The same `Idempotency-Key` sent to two runs' front doors is two requests, one on each run's
    stream (not run A's id for run B, which B's dispatcher would never see); again to A, A's."""
    key = {"Idempotency-Key": "retry-me"}
    async with (
        TestClient(TestServer(create_app(settings_for(redis_url, A)))) as door_a,
        TestClient(TestServer(create_app(settings_for(redis_url, B)))) as door_b,
    ):
        first = await door_a.post("/v1/prefill", json={"prompt": [1, 2, 3]}, headers=key)
        other = await door_b.post("/v1/prefill", json={"prompt": [1, 2, 3]}, headers=key)
        again = await door_a.post("/v1/prefill", json={"prompt": [1, 2, 3]}, headers=key)
        assert (first.status, other.status, again.status) == (202, 202, 200)
        ids = [(await r.json())["id"] for r in (first, other, again)]
    assert ids[0] != ids[1] and ids[2] == ids[0]
    for run in (A, B):
        assert await redis.xlen(keys.prefill_requests_stream(run)) == 1


async def test_a_runs_dispatcher_reads_holds_and_reconciles_only_its_own_runs_requests(
    redis_url: str, redis: Redis
) -> None:
    """B's dispatcher takes B's requests (held: pending on its consumer) and lowers B's drifted
    in-flight count to B's unacked entries; A's requests stay unread by any group, queued, and A's
    count is left as it is."""
    ids = {A: ["a1", "a2"], B: ["b1"]}
    for run, rids in ids.items():
        for rid in rids:
            assert await serving.accept(redis, run, request(run, rid), 100)
    await redis.set(keys.prefill_inflight_key(A), 57)  # both drifted (decrements lost)
    await redis.set(keys.prefill_inflight_key(B), 50)
    ours, theirs = keys.prefill_requests_stream(B), keys.prefill_requests_stream(A)

    async def b_holds_its_requests() -> bool:
        groups: Any = await redis.xinfo_groups(ours) if await redis.exists(ours) else []
        return any(g["name"].decode() == SERVICE and g["pending"] == len(ids[B]) for g in groups)

    async def b_reconciled() -> bool:
        return await serving.inflight(redis, B) == len(ids[B])

    stop = asyncio.Event()
    dispatcher = asyncio.create_task(serve(settings_for(redis_url, B), stop))
    try:
        await until(b_holds_its_requests, "run B's dispatcher holding run B's request")
        await until(b_reconciled, "run B's in-flight count lowered to its own unacked requests")
        assert await redis.xinfo_groups(theirs) == []  # no dispatcher group ever read run A's
        for rid in ids[A]:
            found = await serving.lookup(redis, A, rid)
            assert found is not None and found.status is RequestStatus.QUEUED  # nobody answered them
        assert await serving.inflight(redis, A) == 57  # run B's reconcile never touched it
    finally:
        stop.set()
        await asyncio.wait_for(dispatcher, 30)


async def test_a_runs_front_door_is_gated_only_by_its_own_runs_dispatchers_and_decoders(
    redis_url: str, redis: Redis
) -> None:
    """Run B's dispatcher saying B is finished refuses B's requests (503), not run A's (no
    dispatcher of A's is alive: A's wait for one); run B's decoder, which reads B's decode stream,
    is not one A's front door places prompts on."""
    finished = verdicts.Readiness(
        instance="dispatcher-b", run=B, state=ServingState.FINISHED, reason="run B finished", retry_after_s=5,
        at=time.time(),
    )  # fmt: skip
    await verdicts.publish_readiness(redis, finished)
    decoder_b = Heartbeat(redis, "decoder", "decoder-b", lambda: {"run": B})
    await decoder_b.start()
    try:
        async with (
            TestClient(TestServer(create_app(settings_for(redis_url, A)))) as door_a,
            TestClient(TestServer(create_app(settings_for(redis_url, B)))) as door_b,
        ):
            for door in (door_a, door_b):
                await read_gate(door.app)
                await read_decoders(door.app)
            resp = await door_a.post("/v1/prefill", json={"prompt": [1, 2, 3]})
            assert resp.status == 202, await resp.text()
            resp = await door_b.post("/v1/prefill", json={"prompt": [1, 2, 3]})
            assert resp.status == 503 and "run B finished" in await resp.text()
            assert not door_a.app[GATE].decoder_live and door_b.app[GATE].decoder_live
    finally:
        await decoder_b.stop()
