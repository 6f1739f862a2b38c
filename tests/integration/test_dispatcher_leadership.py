"""One leader dispatcher per run, the others standbys, a deposed leader fenced (issue 62), against a
real redis-server: the service objects in-process for the fence at the write, and real dispatcher
processes (SIGSTOP for a stall) for the standby, the takeover and the deposed leader resuming.

The processes get no workers: the test plays them, announcing a worker (`WorkerJoined`), reading
the batches from its fill stream, answering and reporting them."""

from __future__ import annotations

import asyncio
import io
import signal
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.asyncio import Redis

from bubbletea.launcher.procs import Proc, spawn
from bubbletea.launcher.services import DISPATCHER
from services.dispatcher.dispatcher import SERVICE, Dispatcher
from services.dispatcher.lease import DispatcherLease
from services.dispatcher.takeover import SWEEP_EVERY_S, measurement, publish_measurement
from shared.bus import Bus, Delivery
from shared.bus.streams import claim_all
from shared.config.settings import load_settings
from shared.config.spec import BusConfig
from shared.control import serving, verdicts
from shared.control.leases import release_dispatcher_if_held_by
from shared.model.shape import model_info
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import BubbleClosed, BubbleOpened
from shared.policies.leadership import Move
from shared.policies.prefill_cost import PrefillCostModel
from shared.wire import (
    FIELD,
    PrefillBatch,
    PrefillProgress,
    PrefillReport,
    PrefillRequest,
    PrefillResult,
    WorkerJoined,
    decode,
    keys,
)
from shared.wire.status import DispatcherRole, ItemOutcome, RequestStatus
from tests.integration.test_dispatcher import Acks

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_settings(None).spec
#: Bounds on a loaded 2-core machine, always waited on with an early exit.
START_S, TAKEOVER_S = 60.0, 10.0


def request(run: str, rid: str, tokens: int = 4, *, deadline: float | None = None) -> PrefillRequest:
    return PrefillRequest(
        id=rid,
        model="m",
        tokens=tuple(range(tokens)),
        submitted=time.time(),
        deadline=deadline,
        reply_to=keys.prefill_results_stream(run, "front"),  # a front door of the run's: its tag
    )


def joined(run: str, stage: int, free: int) -> WorkerJoined:
    """A worker of slot (0, `stage`) set up, with typical bubbles of 0.5 s: credit for many requests."""
    return WorkerJoined(
        run=run, worker=f"r0s{stage}", replica=0, stage=stage, typical_bubble_ms=500.0, free_memory_bytes=free,
        at=time.time(),
    )  # fmt: skip


async def batches(r: Redis, stream: str) -> list[PrefillBatch]:
    return [decode(f[FIELD]) for _, f in await r.xrange(stream)]


# --- the fence, in-process --------------------------------------------------------------------


@pytest.mark.parametrize("with_answer", [False, True], ids=["a batch", "a batch and an answer"])
async def test_a_leader_whose_lease_another_took_writes_no_batch_answer_or_ack_though_its_clock_says_it_leads(
    redis_url: str, redis: Redis, with_answer: bool
) -> None:
    """The instant after a stall its clock did not see (a paused VM): it decides a batch (and an
    answer: the other way its writes go), and Redis refuses them in the same atomic step as the
    check; it steps down."""
    run = f"fence-{time.time_ns()}"
    fill = keys.fill_stream(run, 0, 0)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        lease = DispatcherLease(bus.redis, run, "dispatcher-a")
        assert (await lease.step_once()).move is Move.LEAD
        d = Dispatcher(bus, SPEC, run, lease=lease)
        d.acks = acks = Acks(run)
        requests = keys.prefill_requests_stream(run)
        await redis.xgroup_create(requests, SERVICE, id="0", mkstream=True)

        async def arrive(*reqs: PrefillRequest) -> None:  # accepted, read by the dispatcher, held
            for req in reqs:
                assert await serving.accept(bus.redis, run, req, 100)
            read: Any = await redis.xreadgroup(SERVICE, d.instance, {requests: ">"})
            for entry_id, fields in read[0][1]:
                assert await d.on_request(Delivery(entry_id.decode(), "s", decode(fields[FIELD]), 1)) is not None
            await d.requests_read([])

        await d.on_joined(Delivery("j-0", keys.bubbles_stream(run), joined(run, 0, 1 << 30), 1))
        await arrive(request(run, "q1"), request(run, "q2", deadline=time.time() + 1))
        sent = [it.id for b in await batches(redis, fill) for it in b.items]
        assert sorted(sent) == ["q1", "q2"]  # it leads: written
        await redis.set(keys.dispatcher_lease_key(run), "dispatcher-b", px=3_000)  # another took over
        assert lease.leads()  # as far as its own clock knows
        if with_answer:  # q2's deadline passed on its worker: failed, an answer to write
            d._decided += d.state.tick(time.time() + 2)
        await arrive(request(run, "q3"))  # and a batch
        assert [it.id for b in await batches(redis, fill) for it in b.items] == sent  # no other batch
        found = await serving.lookup(redis, run, "q2")
        assert found is not None and found.status is RequestStatus.QUEUED  # not answered
        pending: Any = await redis.xpending(requests, SERVICE)
        assert pending["pending"] == 3 and acks.released == []  # nothing acked: left to the leader
        assert lease.deposed.is_set() and lease.role is DispatcherRole.STANDBY
        assert "Redis refused its writes" in lease.why


async def test_a_leader_stalled_past_its_lease_writes_nothing_and_leaves_what_it_read_pending(
    redis_url: str, redis: Redis
) -> None:
    """Its clock saw the stall: it does not even try (its acks, which go unfenced, included)."""
    run = f"lapse-{time.time_ns()}"
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        # a lease of 1 s: a step heard back within 0.75 s leads (a loaded machine's cluster took more
        # than the 0.15 s a 400 ms lease left), and the stall below outlasts it
        lease = DispatcherLease(bus.redis, run, "dispatcher-a", ttl_ms=1000, renew_every_s=0.25)
        assert (await lease.step_once()).move is Move.LEAD
        d = Dispatcher(bus, SPEC, run, lease=lease)
        d.acks = Acks(run)
        stream = keys.bubbles_stream(run)
        await redis.xgroup_create(stream, SERVICE, id="0", mkstream=True)
        await redis.xadd(stream, {FIELD: b"x"})
        [[_, [(entry_id, _)]]] = await redis.xreadgroup(SERVICE, d.instance, {stream: ">"})
        await asyncio.sleep(0.9)  # the stall itself: no renewal (nothing steps it), past 1 s less the margin
        await d.on_joined(Delivery(entry_id.decode(), stream, joined(run, 0, 1 << 30), 1))
        reader = Acks(run)
        reader.stream = stream
        assert await d.flush(reader, [entry_id.decode()])  # "acked": left for the consumer not to
        assert reader.released == [] and (await redis.xpending(stream, SERVICE))["pending"] == 1
        assert lease.deposed.is_set() and "lapsed" in lease.why


async def test_a_new_leader_takes_its_runs_earlier_dispatchers_entries_at_once_and_no_other_runs(
    redis: Redis,
) -> None:
    """Read a moment ago and refreshed or not, a predecessor's held requests move to the new leader
    now (not after `claim_idle_ms`); another run's live dispatcher, on the same Redis, keeps its
    own: they are on its run's request stream, which the new leader never reads."""
    run, other = f"claim-{time.time_ns()}", f"other-{time.time_ns()}"
    ours, theirs = keys.prefill_requests_stream(run), keys.prefill_requests_stream(other)
    assert ours != theirs
    for stream in (ours, theirs):
        await redis.xgroup_create(stream, SERVICE, id="$", mkstream=True)
        for _ in range(3):
            await redis.xadd(stream, {FIELD: b"x"})
    await redis.xreadgroup(SERVICE, "old", {ours: ">"}, count=2)  # the run's deposed leader
    await redis.xreadgroup(SERVICE, "other", {theirs: ">"}, count=1)  # another run's leader
    assert await claim_all(redis, ours, SERVICE, "new") == 2
    held: Any = await redis.xpending(ours, SERVICE)
    assert {c["name"].decode(): c["pending"] for c in held["consumers"]} == {"new": 2}
    kept: Any = await redis.xpending(theirs, SERVICE)
    assert {c["name"].decode(): c["pending"] for c in kept["consumers"]} == {"other": 1}


async def test_a_supervisor_releases_a_dead_dispatchers_lease_and_no_other(redis: Redis) -> None:
    """`bubbletea up` saw it exit: its successor leads at once rather than at the lease's end."""
    run = f"dead-{time.time_ns()}"
    await redis.set(keys.dispatcher_lease_key(run), "dispatcher-host-1", px=3_000)
    assert not await release_dispatcher_if_held_by(redis, run, "dispatcher-host-2")  # not the holder
    assert await release_dispatcher_if_held_by(redis, run, "dispatcher-host-1")
    assert not await redis.exists(keys.dispatcher_lease_key(run))


# --- real processes ---------------------------------------------------------------------------


@pytest.fixture
def run_env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    """A run's environment, with `bus.claim_idle_ms` a minute: what a new leader takes at once
    it cannot have taken by the usual reclaim."""
    spec = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    spec["bus"] = {**spec.get("bus", {}), "claim_idle_ms": 60_000}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return {
        "REDIS_URL": redis_url,
        "BUBBLETEA_CONFIG": str(path),
        "BUBBLETEA_RUN": f"lead-{time.time_ns()}",
        "BUBBLETEA_LOG_LEVEL": "INFO",
        "BUBBLETEA_TIME_SCALE": "1",
        "BUBBLETEA_METRICS_PORT": "off",
    }


class Dispatchers:
    """Dispatcher processes of one run, each with its whole log."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.procs, self.logs = env, list[Proc](), dict[int, io.StringIO]()

    async def start(self) -> Proc:
        out = io.StringIO()
        p = await spawn(DISPATCHER, self.env, out=out)
        self.procs.append(p)
        self.logs[p.proc.pid] = out
        return p

    def log(self, p: Proc) -> str:
        return self.logs[p.proc.pid].getvalue()

    async def logged(self, p: Proc, text: str, timeout: float = START_S) -> str:
        """The first line of `p`'s log saying `text`, once it says it."""

        async def said() -> bool:
            return text in self.log(p)

        await until(said, f"{text!r} in the log of {name(p)}", timeout)
        return next(line for line in self.log(p).splitlines() if text in line)

    async def stop(self) -> None:
        for p in self.procs:
            if p.proc.returncode is None:
                p.proc.send_signal(signal.SIGCONT)
                p.proc.terminate()
                await asyncio.wait_for(p.proc.wait(), 30)


def name(p: Proc) -> str:
    return f"{SERVICE}-{socket.gethostname()}-{p.proc.pid}"


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float) -> float:
    """Poll stored state (Redis has no event for it) until `check` holds; the seconds it took."""
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def led_by(r: Redis, run: str, who: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await r.get(keys.dispatcher_lease_key(run)) == who.encode()

    return check


def sent(r: Redis, stream: str, ids: set[str]) -> Callable[[], Awaitable[bool]]:
    """Whether every one of `ids` is in some batch on `stream`."""

    async def check() -> bool:
        return ids <= {it.id for b in await batches(r, stream) for it in b.items}

    return check


def held_by(r: Redis, run: str, consumer: str, n: int) -> Callable[[], Awaitable[bool]]:
    """Whether `consumer` holds `n` of `run`'s request entries (read, not acked)."""

    async def check() -> bool:
        rows: Any = await r.xpending_range(keys.prefill_requests_stream(run), SERVICE, "-", "+", 100, consumer)
        return len(rows) == n

    return check


def none_pending(r: Redis, run: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await r.xpending(keys.prefill_requests_stream(run), SERVICE))["pending"] == 0

    return check


def field(line: str, key: str) -> str:
    return next(kv.split("=", 1)[1] for kv in line.split() if kv.startswith(f"{key}="))


async def consumers(r: Redis, run: str) -> set[str]:
    """Every consumer of the dispatcher group on the run's three streams."""
    out = set()
    for stream in (keys.prefill_requests_stream(run), keys.bubbles_stream(run), keys.prefill_reports_stream(run)):
        for c in await r.xinfo_consumers(stream, SERVICE):
            out.add(c["name"].decode() if isinstance(c["name"], bytes) else c["name"])
    return out


async def test_a_second_dispatcher_stands_by_reading_nothing_and_takes_over_at_once_from_a_leader_that_stops(
    run_env: dict[str, str], redis: Redis
) -> None:
    run, ds = run_env["BUBBLETEA_RUN"], Dispatchers(run_env)
    try:
        a = await ds.start()
        await ds.logged(a, "dispatcher ready")
        b = await ds.start()
        line = await ds.logged(b, "standby: another dispatcher leads the run")
        assert field(line, "leader") == name(a)
        async with Bus(run_env["REDIS_URL"], name="test") as bus:
            await bus.publish(keys.bubbles_stream(run), joined(run, 0, 1 << 30))
            for i in range(5):
                assert await serving.accept(bus.redis, run, request(run, f"q{i}"), 100)
        await until(sent(redis, keys.fill_stream(run, 0, 0), {f"q{i}" for i in range(5)}), "the batches", START_S)
        assert await consumers(redis, run) == {name(a)}  # the standby never read a stream
        assert {v.instance for v in await verdicts.readiness(redis, run)} == {name(a)}  # nor says it serves
        assert "dispatcher ready" not in ds.log(b)
        a.proc.terminate()  # a rolling update: the leader stops, and hands the lease over
        took = await until(led_by(redis, run, name(b)), "the standby leads", TAKEOVER_S)
        assert took < keys.DISPATCHER_LEASE_TTL_MS / 1000  # not at the lease's end: handed over
        assert await asyncio.wait_for(a.proc.wait(), 30) == 0
        await ds.logged(b, "dispatcher ready")
    finally:
        await ds.stop()


async def test_a_stalled_leader_is_replaced_by_the_standby_that_serves_its_queue_and_resumed_is_fenced_and_steps_down(
    run_env: dict[str, str], redis: Redis
) -> None:
    """SIGSTOP past its lease: the standby takes over at the lease's end (not at `claim_idle_ms`),
    takes the requests the leader held, counts the batch it had sent to a worker (adopted: its
    requests are not sent again) and sends the rest; the leader, let go on, steps down and sends
    nothing. In the end every request was in exactly one batch, and every one is acked."""
    run, ds = run_env["BUBBLETEA_RUN"], Dispatchers(run_env)
    info = model_info(SPEC.prefill)
    small, big = 4, 64
    room = 2 * info.kv_bytes(small) + info.kv_bytes(small) // 2  # the first worker: two small ones, no big one
    assert info.kv_bytes(big) > room
    fill0, fill1 = keys.fill_stream(run, 0, 0), keys.fill_stream(run, 0, 1)
    try:
        a = await ds.start()
        ready_a = await ds.logged(a, "dispatcher ready")
        b = await ds.start()
        await ds.logged(b, "standby: another dispatcher leads the run")
        async with Bus(run_env["REDIS_URL"], name="test") as bus:
            await bus.publish(keys.bubbles_stream(run), joined(run, 0, room))
            for rid in ("s1", "s2"):
                assert await serving.accept(bus.redis, run, request(run, rid, small), 100)
            await until(sent(redis, fill0, {"s1", "s2"}), "the leader's batch for the first worker", START_S)
            for rid in ("g1", "g2", "g3"):
                assert await serving.accept(bus.redis, run, request(run, rid, big), 100)
            await until(held_by(redis, run, name(a), 5), "the leader holding every request", START_S)
            before = [x.batch_id for x in await batches(redis, fill0)]
            a.proc.send_signal(signal.SIGSTOP)  # a stall: a GC pause, a VM paused
            took = await until(led_by(redis, run, name(b)), "the standby leads", TAKEOVER_S)
            assert took < keys.DISPATCHER_LEASE_TTL_MS / 1000 + 2.0  # the lease's end, on a busy machine
            ready_b = await ds.logged(b, "dispatcher ready", TAKEOVER_S)
            assert int(field(ready_b, "claimed")) >= 5 and int(field(ready_b, "adopted")) == len(before)
            await bus.publish(keys.bubbles_stream(run), joined(run, 1, 1 << 30))  # room for the big ones
            await until(sent(redis, fill1, {"g1", "g2", "g3"}), "the new leader's batches", TAKEOVER_S)
            a.proc.send_signal(signal.SIGCONT)
            await ds.logged(a, "dispatcher steps down", TAKEOVER_S)
            line = await ds.logged(a, "standby: another dispatcher leads the run", TAKEOVER_S)
            assert field(line, "leader") == name(b)
            sent_all = await batches(redis, fill0) + await batches(redis, fill1)
            mine = field(ready_a, "batches") + "-"
            assert [x.batch_id for x in sent_all if x.batch_id.startswith(mine)] == before  # none after its stall
            assert Counter(it.id for x in sent_all for it in x.items) == dict.fromkeys(
                ("s1", "s2", "g1", "g2", "g3"), 1
            )
            for x in sent_all:  # the workers answer, and report: the new leader acks every request
                for it in x.items:
                    done_ = PrefillResult(id=it.id, status=RequestStatus.DONE)
                    await serving.answer(redis, run, done_, keys.prefill_results_stream(run, "front"))
                done = tuple(
                    PrefillProgress(id=it.id, outcome=ItemOutcome.DONE, reached_layer=info.layers, seconds=0.001)
                    for it in x.items
                )
                report = PrefillReport(
                    run=run, worker=x.worker, batch_id=x.batch_id, progress=done, preempted=False, at=time.time()
                )
                await bus.publish(keys.prefill_reports_stream(run), report)
            await until(none_pending(redis, run), "every request acked", TAKEOVER_S)
    finally:
        await ds.stop()


async def test_what_a_deposed_leader_holds_after_the_takeover_is_taken_over_within_a_sweep(
    run_env: dict[str, str], redis: Redis
) -> None:
    """A deposed leader let go on after a stall can read entries before its fence stops it, after
    the new leader claimed: those move to the leader within `takeover.SWEEP_EVERY_S` (not after
    `bus.claim_idle_ms`, a minute here). The stale holder is made by this test: the leader's held
    request moved (XCLAIM) to another dispatcher's name; the whole path (a stalled leader's late
    read, then its report handled by its successor) is the stalled-leader test above."""
    run, ds = run_env["BUBBLETEA_RUN"], Dispatchers(run_env)
    requests = keys.prefill_requests_stream(run)
    try:
        a = await ds.start()
        await ds.logged(a, "dispatcher ready")
        async with Bus(run_env["REDIS_URL"], name="test") as bus:
            assert await serving.accept(bus.redis, run, request(run, "late"), 100)  # no worker: held, queued
            await until(held_by(redis, run, name(a), 1), "the leader holds the request", START_S)
            [row] = await redis.xpending_range(requests, SERVICE, "-", "+", 10)
            await redis.xclaim(requests, SERVICE, "dispatcher-deposed", 0, [row["message_id"]], justid=True)
            assert await held_by(redis, run, "dispatcher-deposed", 1)()
            took = await until(held_by(redis, run, name(a), 1), "the leader holds it again", TAKEOVER_S)
            assert took < SWEEP_EVERY_S + 2.0  # a sweep, on a busy machine
            await bus.publish(keys.bubbles_stream(run), joined(run, 0, 1 << 30))
            await until(sent(redis, keys.fill_stream(run, 0, 0), {"late"}), "the leader's batch", TAKEOVER_S)
        assert "took over entries another dispatcher read" in ds.log(a)
    finally:
        await ds.stop()


async def test_the_leaders_measurement_is_published_for_the_next_leader_once_measured(redis: Redis) -> None:
    """`publish_measurement` writes nothing before the pipeline came round, then the rate a new
    leader starts from (`measurement`), with its TTL; an unreadable record is not taken over."""
    run = f"measured-{time.time_ns()}"
    state = DispatchState[Any](layers=4, max_batch=8, cost=PrefillCostModel(prior=[(10, 0.01), (1000, 1.0)]))
    await publish_measurement(redis, run, state)
    assert await measurement(redis, run) is None  # nothing measured yet: nothing published
    now = time.time()
    for i in range(3):
        for w in ("w0", "w1"):
            at = now - 0.3 + i * 0.1
            state.bubble_start(BubbleOpened(w, f"fill:{w}", 0.02, 0, started=at, tag=(i, 1)), at)
            state.bubble_end(BubbleClosed(w, (i, 1), 0.03), now=at)
    await publish_measurement(redis, run, state)
    got = await measurement(redis, run)
    assert got is not None and got.rate == pytest.approx(0.6) and got.came_round
    assert 0 < await redis.ttl(keys.dispatcher_measured_key(run)) <= keys.DISPATCHER_MEASURED_TTL_S
    await redis.set(keys.dispatcher_measured_key(run), b"not json")
    assert await measurement(redis, run) is None


async def test_a_leader_deposed_then_leading_again_counts_a_new_term(redis: Redis) -> None:
    """`deposed` is clear again once a dispatcher leads again; a term that slept through both (an
    outage's backoff) tells by `terms` that it was deposed, and ends (services/dispatcher/serve.py):
    a failover run's term that went on through one kept a requests consumer that read nothing more."""
    run = f"terms-{time.time_ns()}"
    lease = DispatcherLease(redis, run, "dispatcher-a", ttl_ms=1500, renew_every_s=0.5)  # 1.25 s to hear back
    assert (await lease.step_once()).move is Move.LEAD and lease.terms == 1
    began = lease.terms
    await redis.set(keys.dispatcher_lease_key(run), "dispatcher-b", px=300)  # another holds it a moment
    await lease.step_once()
    assert lease.deposed.is_set()
    await asyncio.sleep(0.4)  # its lease ends
    assert (await lease.step_once()).move is Move.LEAD
    assert not lease.deposed.is_set() and lease.terms == began + 1


async def test_each_datacenters_dispatchers_share_their_own_lease(redis: Redis) -> None:
    """With a dispatcher per datacenter, a DC's dispatchers contend for its lease alone: one leads
    each DC, the other stands by; the run's lease is untouched; a leader released (it stopped, or
    its supervisor saw it die) is replaced by its DC's standby, not by another DC's dispatcher."""
    run = f"perdc-{time.time_ns()}"
    a1, a2 = DispatcherLease(redis, run, "a1", dc="dc-a"), DispatcherLease(redis, run, "a2", dc="dc-a")
    b1 = DispatcherLease(redis, run, "b1", dc="dc-b")
    assert (await a1.step_once()).move is Move.LEAD
    assert (await b1.step_once()).move is Move.LEAD  # another DC: its own lease
    assert (await a2.step_once()).move is not Move.LEAD and a2.leader == "a1"
    assert not await redis.exists(keys.dispatcher_lease_key(run))
    assert await release_dispatcher_if_held_by(redis, run, "a1", "dc-a")
    assert not await release_dispatcher_if_held_by(redis, run, "b1", "dc-a")  # not that DC's holder
    assert (await a2.step_once()).move is Move.LEAD
    assert (
        await redis.get(keys.dispatcher_lease_key(run, "dc-a")),
        await redis.get(keys.dispatcher_lease_key(run, "dc-b")),
    ) == (
        b"a2",
        b"b1",
    )
