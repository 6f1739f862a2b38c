"""A request the dispatcher cannot handle is answered, failed, and counted out of flight (issue 62):
before, a dead-lettered request was never answered (its client waited out its deadline) and never
counted down, so the run's `bt:{<run>}:prefill:inflight` crept toward `prefill.max_queue_depth` and ended in permanent
429s. And the count is reconciled with the request stream, so no drift lasts.

A real redis-server, the bus's real consumer, the serving scripts the services run."""

from __future__ import annotations

import functools
import time
from typing import Any

import msgspec
from redis.asyncio import Redis

from shared.bus import Bus, Delivery, Reject
from shared.config.spec import BusConfig
from shared.control import serving
from shared.wire import FIELD, PrefillRequest, PrefillResult, decode, keys
from shared.wire.status import FailureReason, RequestStatus

GROUP = "dispatcher"
RUN = "dead"
REQUESTS, INFLIGHT = keys.prefill_requests_stream(RUN), keys.prefill_inflight_key(RUN)
FAST = BusConfig(block_ms=50, claim_idle_ms=200, max_deliveries=2)
RESULTS = keys.prefill_results_stream(RUN, "front")  # a front door's: the run's tag


def request(rid: str, reply_to: str = RESULTS) -> PrefillRequest:
    return PrefillRequest(id=rid, model="m", tokens=(1, 2, 3), submitted=time.time(), reply_to=reply_to)


async def answers(redis: Redis, stream: str = RESULTS) -> list[PrefillResult]:
    rows: Any = await redis.xrange(stream)
    return [m for _, f in rows if isinstance(m := decode(f[FIELD]), PrefillResult)]


async def test_a_dead_lettered_request_is_failed_through_the_answer_path_and_counted_out(
    redis_url: str, redis: Redis
) -> None:
    """One the handler rejects, and one written by another wire version (undecodable as ours, its
    id and reply stream still readable): each is answered failed at once, and in flight drops to 0."""
    assert await serving.accept(redis, RUN, request("r-1"), 100)
    foreign = msgspec.msgpack.encode({"kind": "prefill_request", "v": 99, "id": "r-2", "reply_to": RESULTS})
    await redis.incr(INFLIGHT)  # a newer front door accepted it (and counted it)
    await redis.xadd(REQUESTS, {FIELD: foreign})
    assert int(await redis.get(INFLIGHT)) == 2

    async def refuse(d: Delivery) -> None:
        raise Reject("cannot take it")

    async with Bus(redis_url, FAST) as bus:
        last_word = functools.partial(serving.fail_dead_request, bus.redis, RUN)
        c = bus.consumer(REQUESTS, GROUP, {PrefillRequest: refuse}, last_word=last_word)
        async with c:
            deadline = time.monotonic() + 30
            while c.stats.dead_lettered < 2:
                assert time.monotonic() < deadline, (c.stats, await answers(redis))
                await redis.xread({keys.run_dead_letter_stream(RUN): "$"}, block=100)  # wakes as one is written
    got = {a.id: a for a in await answers(redis)}
    assert set(got) == {"r-1", "r-2"}
    assert all(a.status is RequestStatus.FAILED and a.reason is FailureReason.DEAD_LETTERED for a in got.values())
    assert "cannot take it" in got["r-1"].error
    assert int(await redis.get(INFLIGHT)) == 0
    # the run's dead letters are in the run's own dead-letter stream (its tag: one slot with its XACKs)
    assert await redis.xlen(keys.run_dead_letter_stream(RUN)) >= 2
    found = await serving.lookup(redis, RUN, "r-1")
    assert found is not None and found.status is RequestStatus.FAILED


async def test_a_request_answered_outside_its_run_is_dead_lettered_unanswered(redis_url: str, redis: Redis) -> None:
    """A request naming a results stream outside its run's tag (no front door of the run reads it; on
    a cluster, another slot) is dead-lettered, not answered there: the consumer goes on, and the
    next request is failed through the answer path as usual."""
    elsewhere = keys.prefill_results_stream("another-run", "front")
    assert await serving.accept(redis, RUN, request("astray", elsewhere), 100)
    assert await serving.accept(redis, RUN, request("r-3"), 100)

    async def refuse(d: Delivery) -> None:
        raise Reject("cannot take it")

    async with Bus(redis_url, FAST) as bus:
        last_word = functools.partial(serving.fail_dead_request, bus.redis, RUN)
        async with bus.consumer(REQUESTS, GROUP, {PrefillRequest: refuse}, last_word=last_word) as c:
            deadline = time.monotonic() + 30
            while c.stats.dead_lettered < 2:
                assert time.monotonic() < deadline, c.stats
                await redis.xread({keys.run_dead_letter_stream(RUN): "$"}, block=100)
    assert [a.id for a in await answers(redis)] == ["r-3"]
    assert await answers(redis, elsewhere) == []  # nothing written outside the run


async def test_a_last_word_that_fails_leaves_the_entry_dead_lettered_not_pending(redis_url: str, redis: Redis) -> None:
    """A last word that raises (a bug, a command the server refuses) does not keep the entry pending
    to fail again at every redelivery: it is dead-lettered, the failure named in its record."""
    assert await serving.accept(redis, RUN, request("r-bug"), 100)

    async def refuse(d: Delivery) -> None:
        raise Reject("cannot take it")

    async def broken(raw: bytes | None, error: str) -> None:
        raise ValueError("a bug in the last word")

    async with Bus(redis_url, FAST) as bus:
        async with bus.consumer(REQUESTS, GROUP, {PrefillRequest: refuse}, last_word=broken) as c:
            deadline = time.monotonic() + 30
            while c.stats.dead_lettered < 1:
                assert time.monotonic() < deadline, c.stats
                await redis.xread({keys.run_dead_letter_stream(RUN): "$"}, block=100)
        assert c.error is None
    [letter] = [x for x in await bus_letters(redis_url) if "r-bug" in str(x.payload)]
    assert "cannot take it" in letter.error and "a bug in the last word" in letter.error
    assert int((await redis.xpending(REQUESTS, GROUP))["pending"]) == 0


async def bus_letters(redis_url: str) -> list[Any]:
    async with Bus(redis_url) as bus:
        return await bus.dead_letters(keys.run_dead_letter_stream(RUN), 1000)


async def test_the_inflight_count_is_reconciled_with_the_unacked_requests(redis_url: str, redis: Redis) -> None:
    """A drifted count (decrements lost) is lowered to what the stream holds unacked: read and
    pending, plus not read yet."""
    for rid in ("a", "b", "c"):
        assert await serving.accept(redis, RUN, request(rid), 100)
    await redis.xgroup_create(REQUESTS, GROUP, id="0")
    await redis.xreadgroup(GROUP, "me", {REQUESTS: ">"}, count=2)  # two pending
    [(entry, _)] = (await redis.xrange(REQUESTS, count=1))[:1]
    await redis.xack(REQUESTS, GROUP, entry)  # one answered and acked
    await redis.set(INFLIGHT, 57)  # crept
    assert await serving.reconcile_inflight(redis, RUN, GROUP) == 2  # one pending, one not read
    assert int(await redis.get(INFLIGHT)) == 2
    # never raised: a pending entry may be one answered and not acked yet (a dead dispatcher's)
    await redis.set(INFLIGHT, 1)
    assert await serving.reconcile_inflight(redis, RUN, GROUP) == 1
    assert await serving.reconcile_inflight(redis, RUN, "no-such-group") is None
