"""The dispatcher service against a real redis-server: its streams dead-letter every kind outside
their handler tables (naming stream and kind, keeping the payload), and a request whose deadline
passes in the queue is failed explicitly, then its held entry acked; a spent partial prefill is
deleted; a worker that joins gets its first credit; what a read decides goes out in one round
trip; a request is looked up in Redis only when it is delivered again; a move to the decoder is
answered as one."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import pytest
from redis.asyncio import Redis

from services.dispatcher.dispatcher import Dispatcher
from services.dispatcher.serve import last_writes, serve
from shared.bus import Bus, Delivery, Reject
from shared.config.settings import load_settings
from shared.config.spec import BusConfig
from shared.control import serving
from shared.control.health import Heartbeat
from shared.policies.decisions import Decisions, Spent
from shared.policies.readiness import BUBBLE_RECHECK_S
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import (
    FIELD,
    BubbleEnd,
    BubbleStart,
    ControlSeen,
    Ping,
    PrefillBatch,
    PrefillReport,
    PrefillRequest,
    WorkerJoined,
    decode,
    encode,
    keys,
)
from shared.wire.status import ControlEvent, FailureReason, RequestStatus


def front(d: Dispatcher) -> str:
    """A front door's results stream in `d`'s run (the dispatcher refuses a request answered elsewhere)."""
    return keys.prefill_results_stream(d.run, "front")


async def test_every_stream_dead_letters_kinds_outside_its_table(redis_url: str, redis: Redis) -> None:
    settings = dataclasses.replace(load_settings(None), redis_url=redis_url, run="t")
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop))
    streams = {
        keys.prefill_requests_stream("t"): "prefill_request",
        keys.bubbles_stream("t"): "bubble_end, bubble_start, prefill_off, worker_joined",
        keys.prefill_reports_stream("t"): "prefill_report",
    }
    try:
        async with Bus(redis_url, name="test") as bus:
            for stream in streams:
                await bus.publish(stream, Ping(seq=1, sent_ns=0))
            errors: dict[str, bytes] = {}
            cursor = "0"
            while len(errors) < len(streams):
                reply = await redis.xread({keys.run_dead_letter_stream("t"): cursor}, block=30_000)
                assert reply, f"dead letters so far: {errors}"
                for entry_id, f in reply[0][1]:
                    cursor = entry_id.decode()
                    errors[f[b"stream"].decode()] = f[b"error"]
                    assert isinstance(decode(f[FIELD]), Ping)  # the payload is kept
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
    for stream, takes in streams.items():
        assert errors[stream] == f"rejected: stream {stream} takes {takes}; got kind 'ping'".encode()


class Acks:
    """The request consumer as the dispatcher sees it: held entries acked in its round trip."""

    group = "dispatcher"

    def __init__(self, run: str) -> None:
        self.stream = keys.prefill_requests_stream(run)
        self.released: list[str] = []

    def forget_held(self, ids: list[str]) -> None:  # acked in the dispatcher's round trip
        self.released += ids

    def release_all(self, ids: list[str]) -> None:  # left to the consumer's own acks
        self.released += ids


async def test_a_request_whose_deadline_passes_in_the_queue_fails_explicitly(redis_url: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, "run")
        d.acks = acks = Acks(d.run)
        now = time.time()
        req = PrefillRequest(id="late", model="m", tokens=(1, 2), submitted=now, deadline=now + 0.05, reply_to=front(d))
        assert await serving.accept(bus.redis, d.run, req, 10)
        snapshot = keys.prefill_snapshot_key("run", "late", 2)  # a partial prefill saved for it earlier
        await bus.redis.set(snapshot, b"state", ex=300)
        assert await d.on_request(Delivery("1-0", "s", req, 1)) is not None  # held until answered or failed
        await d.requests_read([])
        d._decided = d.state.tick(now + 0.1)  # no bubble ever opened: past the deadline
        await d.flush()
        assert acks.released == ["1-0"]
        assert not await bus.redis.exists(snapshot)  # it will not resume: its saved state is gone
        got = await serving.lookup(bus.redis, d.run, "late")
        assert got is not None and got.status is RequestStatus.FAILED and got.result is not None
        assert got.result.reason is FailureReason.DEADLINE and "deadline passed" in got.result.error
        assert await serving.inflight(bus.redis, d.run) == 0
        # redelivered after a restart: already answered, so acked at once and not queued again
        assert await d.on_request(Delivery("1-0", "s", req, 2)) is None and d.state.requests == {}
        assert encode(got.result)  # the stored answer is a whole message


async def test_a_request_moved_to_the_decoder_is_answered_moved_not_failed(redis_url: str) -> None:
    """A request with an objective that may move, before any bubble: the policy moves it at once
    (`Moved`, its own decision, not a failure). Its answer says MOVED (reason to_decoder) for the
    front door to have the decoder compute it, its held entry is acked, its saved states go, it is
    counted out of flight, and the failure log stays quiet."""
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, f"moved-{time.time_ns()}")
        acks = Acks(d.run)
        d.acks = acks
        now = time.time()
        req = PrefillRequest(
            id="moves",
            model="m",
            tokens=(1, 2, 3),
            submitted=now,
            reply_to=front(d),
            deadline=now + 60,
            objective=now + 0.5,  # with a decoder to move to (`may_move`), and no bubble seen yet
            may_move=True,
        )
        assert await serving.accept(bus.redis, d.run, req, 10)
        snapshot = keys.prefill_snapshot_key(d.run, "moves", 1)
        await bus.redis.set(snapshot, b"state", ex=300)
        assert await d.on_request(Delivery("1-0", "s", req, 1)) is not None
        await d.requests_read([])  # decided and written in the read's flush
        assert acks.released == ["1-0"] and "moves" not in d.state.requests
        got = await serving.lookup(bus.redis, d.run, "moves")
        assert got is not None and got.status is RequestStatus.MOVED and got.result is not None
        assert got.result.reason is FailureReason.TO_DECODER and "no bubble yet" in got.result.error
        assert not await bus.redis.exists(snapshot)
        assert await serving.inflight(bus.redis, d.run) == 0
        assert d.state.counts.moved == 1


async def test_spent_partial_prefills_are_deleted_and_others_kept(redis_url: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, "run")
        spent, kept = keys.prefill_snapshot_key("run", "a", 2), keys.prefill_snapshot_key("run", "a", 3)
        for key in (spent, kept):
            await bus.redis.set(key, b"state", ex=300)
        d._decided = Decisions(spent=(Spent("a", 2),))
        await d.flush()
        assert not await bus.redis.exists(spent) and await bus.redis.exists(kept)


async def test_a_request_answered_outside_its_run_is_rejected(redis_url: str) -> None:
    """architecture.md: a request whose results stream is not its run's is dead-lettered at once
    (`Reject`): no front door of the run reads there, and on a cluster no script could answer there."""
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, "run")
        stray = keys.prefill_results_stream("another-run", "front")
        req = PrefillRequest(id="stray", model="m", tokens=(1, 2, 3), submitted=time.time(), reply_to=stray)
        with pytest.raises(Reject, match="outside run run's streams"):
            await d.on_request(Delivery("1-0", "s", req, 1))


async def test_a_joined_worker_gets_its_first_credit_on_its_fill_stream(redis_url: str) -> None:
    """`WorkerJoined` (sent by a worker that has set up, before the start barrier): a request
    already queued goes to that worker's fill stream once the read is handled, for its queue."""
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, "run")
        d.acks = Acks(d.run)
        now = time.time()
        req = PrefillRequest(id="early", model="m", tokens=(1, 2, 3), submitted=now, reply_to=front(d))
        assert await serving.accept(bus.redis, d.run, req, 10)
        assert await d.on_request(Delivery("1-0", "s", req, 1)) is not None  # no worker yet: it waits
        await d.requests_read([])
        fill = keys.fill_stream("run", 0, 1)
        assert await bus.redis.xlen(fill) == 0
        joined = WorkerJoined(
            run="run", worker="r0s1", replica=0, stage=1, typical_bubble_ms=50.0, free_memory_bytes=1 << 30, at=now
        )
        await d.on_joined(Delivery("2-0", keys.bubbles_stream("run"), joined, 1))
        assert await bus.redis.xlen(fill) == 0  # decided; written with the rest of the read
        await d.flush()
        [(_, fields)] = await bus.redis.xrange(fill)
        batch = decode(fields[FIELD])
        assert isinstance(batch, PrefillBatch) and [i.id for i in batch.items] == ["early"]
        assert batch.items[0].predicted_ms > 0  # what the item counts for in the worker's credit
        assert d.state.requests["early"].on_worker == "r0s1"


async def test_a_read_of_requests_goes_out_in_one_round_trip_and_only_redeliveries_are_looked_up(
    redis_url: str,
) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, f"one-{time.time_ns()}")
        d.acks = Acks(d.run)
        now = time.time()
        joined = WorkerJoined(
            run=d.run, worker="r0s0", replica=0, stage=0, typical_bubble_ms=500.0, free_memory_bytes=1 << 30, at=now
        )
        await d.on_joined(Delivery("j-0", keys.bubbles_stream(d.run), joined, 1))
        await d.flush()
        calls = []
        execute_command = bus.redis.execute_command

        async def counting(*args: object, **kw: object) -> object:
            calls.append(args[0])
            return await execute_command(*args, **kw)

        bus.redis.execute_command = counting  # type: ignore[method-assign]
        for i in range(20):
            req = PrefillRequest(id=f"q{i}", model="m", tokens=(1, 2, 3), submitted=now, reply_to=front(d))
            assert await d.on_request(Delivery(f"{i}-0", "s", req, 1)) is not None
        assert calls == []  # first deliveries: no lookup
        real_pipeline = bus.redis.pipeline
        pipelines = []

        def counting_pipeline(*args: object, **kw: object) -> object:
            pipelines.append(1)
            return real_pipeline(*args, **kw)

        bus.redis.pipeline = counting_pipeline  # type: ignore[method-assign]
        await d.requests_read([])
        assert len(pipelines) == 1 and calls == []  # one pipelined round trip for every batch
        assert d.state.workers["r0s0"].held  # the requests went to the worker
        again = PrefillRequest(id="q0", model="m", tokens=(1, 2, 3), submitted=now, reply_to=front(d))
        await d.on_request(Delivery("0-0", "s", again, 2))  # delivered again: looked up
        assert calls and calls[0] == "HMGET"


async def test_it_records_which_bubbles_opened_with_work_and_how_late_reports_came(redis_url: str) -> None:
    """`ControlSeen` on the run's spans stream (what the run's figures count every bubble by): a
    bubble that opens with a request queued is 'with work', one with nothing waiting is not, and a
    batch report carries when the worker sent it; the timer publishes them, in one round trip."""
    RUN = f"seen-{time.time_ns()}"  # its own run: the suite's Redis is shared by every test
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, RUN)
        d.acks = Acks(d.run)

        def start(at: float, it: int) -> Delivery:
            msg = BubbleStart(
                run=RUN, worker="r0s1", replica=0, stage=1, dc="dc-a", iteration=it, position=0,
                predicted_ms=50.0, free_memory_bytes=1 << 30, at=at,
            )  # fmt: skip
            return Delivery(f"{it}-0", keys.bubbles_stream(RUN), msg, 1)

        now = time.time() - 1.0  # the events were sent a moment ago: each is seen after it was sent
        await d.on_start(start(now, 0))  # nothing queued
        await d.flush()
        await d.on_end(
            Delivery("e-0", keys.bubbles_stream(RUN), BubbleEnd(
                run=RUN, worker="r0s1", replica=0, stage=1, iteration=0, position=0,
                predicted_ms=50.0, actual_ms=1.0, at=now + 0.001,
            ), 1)
        )  # fmt: skip
        req = PrefillRequest(
            id="q", model="m", tokens=(1, 2, 3), submitted=now, reply_to=keys.prefill_results_stream(RUN, "front")
        )
        assert await serving.accept(bus.redis, d.run, req, 10)
        assert await d.on_request(Delivery("1-0", "s", req, 1)) is not None
        await d.requests_read([])  # held on r0s1 (its credit): work for it
        await d.on_start(start(now + 0.002, 1))
        report = PrefillReport(run=RUN, worker="r0s1", batch_id="none", progress=(), preempted=False, at=now + 0.003)
        await d.on_report(Delivery("r-0", keys.prefill_reports_stream(RUN), report, 1))
        assert not await bus.redis.exists(keys.spans_stream(RUN))  # kept for the timer: no hop in a handler
        await d.tick()
        seen = [decode(f[FIELD]) for _, f in await bus.redis.xrange(keys.spans_stream(RUN))]
    assert [(c.event, c.at, c.with_work) for c in seen if isinstance(c, ControlSeen)] == [
        (ControlEvent.BUBBLE_START, now, False),
        (ControlEvent.BUBBLE_START, now + 0.002, True),
        (ControlEvent.REPORT, now + 0.003, False),
    ]
    assert all(c.seen >= c.at for c in seen)


async def test_a_stopping_dispatcher_whose_redis_died_tries_its_last_writes_for_seconds() -> None:
    """Its launcher killed with SIGKILL, its embedded Redis dies with it and the dispatcher gets
    SIGTERM: its last writes (bubble records kept, readiness, heartbeat) must not ride the outage
    out for 30 s, as a publish does (a CI run saw it outlive its launcher by more than 30 s)."""
    server = EmbeddedRedis().start()
    async with Bus(server.url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, "gone")
        hb = Heartbeat(bus.redis, "dispatcher", "gone-1", dict)
        await hb.start()
        d.telemetry.seen(ControlEvent.BUBBLE_START, "r0s1", time.time(), time.time())
        server.stop()
        t0 = time.monotonic()
        await last_writes(d, hb, within_s=1.0)
        took = time.monotonic() - t0
    assert d.telemetry.kept, "written to a Redis that is gone?"
    assert took < 4.0, f"the last writes took {took:.1f}s"


async def test_bubbles_coming_while_it_is_not_ready_check_readiness_at_most_every_50_ms(redis_url: str) -> None:
    """A fresh bubble start seen while the verdict is not ready checks readiness at once (training
    runs: say so now), but not at every one: with every worker off prefill the verdict stays unready
    while bubbles come, and a check (two reads and a MULTI) at each of thousands a second was half
    of a dispatcher's CPU (`readiness.BUBBLE_RECHECK_S`)."""
    RUN = f"recheck-{time.time_ns()}"
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        d = Dispatcher(bus, load_settings(None).spec, RUN)
        checks = 0
        check = d.check_readiness

        async def counted() -> None:
            nonlocal checks
            checks += 1
            await check()

        d.check_readiness = counted  # type: ignore[method-assign]
        now = time.time()
        for it in range(200):  # a burst: every one fresh, the verdict never ready (no slot is held)
            msg = BubbleStart(
                run=RUN, worker="r0s1", replica=0, stage=1, dc="dc-a", iteration=it, position=0,
                predicted_ms=5.0, free_memory_bytes=1 << 30, at=now,
            )  # fmt: skip
            await d.on_start(Delivery(f"{it}-0", keys.bubbles_stream(RUN), msg, 1))
        assert not d.verdict.ready and 1 <= checks <= 1 + (time.time() - now) / BUBBLE_RECHECK_S
        await asyncio.sleep(BUBBLE_RECHECK_S)
        await d.on_start(Delivery("x-0", keys.bubbles_stream(RUN), msgspec.structs.replace(msg, at=time.time()), 1))
        assert checks >= 2  # the next one, past the interval, checks again
