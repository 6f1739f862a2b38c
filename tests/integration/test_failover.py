"""A master failover loses no accepted request (shared/bus/replicated.py, `serving.accept`).

On a real embedded cluster of its own, a small load of accepts runs while the master holding the
run's slot is SIGKILLed (by PID); each accept that fails in the outage is retried with its
idempotency key (as a client retries), and every request a 2xx would have been given for must then
be on the promoted replica: its record, and its entry on the run's request stream. The old master
is brought back and rejoins as a replica, and a second kill of the new master loses nothing either.
A worker's slot lease, expired while the slot had no master, is taken back after each failover
(services/stage_worker/membership/lease.py: a failover is not a Redis restarted empty), and a
worker's batch finishing during an outage is written once Redis is back (fill/reporting.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch
from redis.asyncio import Redis

from services.stage_worker.fill.batch import Outcome
from services.stage_worker.fill.reporting import Reporter
from services.stage_worker.membership.lease import SlotLease
from services.stage_worker.port.stage_port import PrefillPort, StagePort
from shared.bus import Bus
from shared.bus.connection import client_for, command_client, ride_out
from shared.bus.replicated import replicated
from shared.control import serving
from shared.model.prefill import PrefillResult as ModelResult
from shared.runtime.redis_cluster import NODE_TIMEOUT_MS, EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import PrefillBatch, PrefillItem, PrefillReport, PrefillRequest, PrefillResult, decode, keys

#: How long a killed master's slot may stay unwritable (node timeout, election, our 2 s backoff cap,
#: a loaded 2-core box's slack), as in test_redis_cluster.py.
FAILOVER_BOUND_S = NODE_TIMEOUT_MS / 1000 + 12.0


def _request(run: str, rid: str) -> PrefillRequest:
    now = time.time()
    return PrefillRequest(
        id=rid,
        model="m",
        tokens=(1, 2, 3),
        submitted=now,
        deadline=now + 600,
        reply_to=keys.prefill_results_stream(run, "fd"),
    )


class Accepts:
    """Accepts at about `rate` a second, each retried (same idempotency key) through an outage."""

    def __init__(self, r: Redis, run: str, rate: float) -> None:
        self.r, self.run, self.rate = r, run, rate
        self.accepted: set[str] = set()
        self.stop = asyncio.Event()

    async def one(self) -> None:
        rid, idem = f"pf-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
        req = _request(self.run, rid)
        got = await ride_out(
            lambda: serving.accept(self.r, self.run, req, 10_000, idempotency_key=idem),
            "test accept",
            give_up_s=FAILOVER_BOUND_S + 10,
        )
        # a str: a retry found its key used (the first try was applied, its reply lost)
        self.accepted.add(got if isinstance(got, str) else rid)
        assert got, "refused: the in-flight limit is far above this load"

    async def drive(self) -> None:
        tasks: list[asyncio.Task[None]] = []
        while not self.stop.is_set():
            tasks.append(asyncio.create_task(self.one()))
            await asyncio.sleep(1 / self.rate)
        await asyncio.gather(*tasks)


async def _missing(r: Redis, run: str, ids: set[str]) -> list[str]:
    """The ids of `ids` whose record or request-stream entry the cluster does not hold."""
    on_stream = {serving.request_of(f[b"m"]) for _, f in await r.xrange(keys.prefill_requests_stream(run))}
    streamed = {found[0] for found in on_stream if found is not None}
    missing = []
    for rid in sorted(ids):
        if await serving.lookup(r, run, rid) is None or rid not in streamed:
            missing.append(rid)
    return missing


def test_the_fence_key_shares_the_slot_of_its_key() -> None:
    assert keys.replication_fence_key("bt:{run-1}:prefill:requests") == "bt:{run-1}:replicated"
    assert keys.replication_fence_key("bt:ping") == "bt:{bt:ping}:replicated"


async def test_replicated_on_one_redis_is_one_round_trip_without_wait(redis_server: EmbeddedRedis) -> None:
    r = command_client(redis_server.url)
    try:
        out = await replicated(
            r,
            "bt:{t}:x",
            lambda pipe: pipe.set("bt:{t}:x", "1"),
            "test",
            then=lambda pipe: pipe.get("bt:{t}:x"),
        )
        assert out == [True], "only `queue`'s replies; no WAIT reply on a plain Redis"
    finally:
        await r.aclose()


async def test_replicated_writes_are_on_the_replica_when_it_returns(redis_cluster: EmbeddedCluster) -> None:
    """WAIT went on the writes' own connection: the replica of the key's master holds every one
    when `replicated` returns (read from the replica itself, READONLY)."""
    r = command_client(redis_cluster.url)
    key = f"bt:{{wait-{uuid.uuid4().hex[:6]}}}:x"
    master = redis_cluster.master_of(key)
    replica = next(n for n in redis_cluster.nodes() if n.master_id == master.node_id)
    direct = client_for(f"redis://127.0.0.1:{replica.port}/0")
    try:
        await direct.execute_command("READONLY")
        for i in range(20):
            out = await replicated(r, key, lambda pipe, i=i: pipe.set(key, str(i)), "test")
            assert out == [True]
            assert await direct.get(key) == str(i).encode()
    finally:
        await direct.aclose()
        await r.aclose()


@pytest.mark.timeout(120)
async def test_no_accepted_request_is_lost_when_the_runs_master_is_killed_twice() -> None:
    cluster = await asyncio.to_thread(EmbeddedCluster().start)  # its own: this test kills nodes
    run = f"fo-{uuid.uuid4().hex[:6]}"
    r = command_client(cluster.url)
    lease = SlotLease(r, run, pp=1, dp=1, holder="w0")
    try:
        await lease.acquire()
        stream = keys.prefill_requests_stream(run)
        assert cluster.master_of(stream).port == cluster.master_of(keys.lease_key(run, 0, 0)).port
        for kill in range(2):
            load = Accepts(r, run, rate=100)
            loader = asyncio.create_task(load.drive())
            await asyncio.sleep(0.5)
            old = cluster.master_of(stream)
            replica = next(n for n in cluster.nodes() if n.master_id == old.node_id)
            cluster.kill(old.port)
            killed_at = time.monotonic()
            await asyncio.sleep(1.0)
            # accepts go on failing and being retried until the replica is promoted
            await ride_out(lambda: r.set(keys.replication_fence_key(stream), "x"), "test", give_up_s=FAILOVER_BOUND_S)
            took = time.monotonic() - killed_at
            await asyncio.sleep(0.5)
            load.stop.set()
            await loader
            assert cluster.master_of(stream).port == replica.port
            assert took < FAILOVER_BOUND_S, f"the slot took {took:.1f} s to come back"
            assert len(load.accepted) > 50
            assert await _missing(r, run, load.accepted) == [], f"kill {kill}: accepted requests lost"
            # the lease expired while its master was down (longer than its TTL); the promoted replica
            # continues the old master's data, so it is an outage to ride out, not Redis wiped
            # `watch` and a consumer's `fence` both renew, at once: the second finds the first's take
            await asyncio.gather(lease.renew(last_ok=killed_at), lease.renew(last_ok=killed_at))
            assert await r.get(keys.lease_key(run, 0, 0)) == b"w0"
            if kill == 0:  # the old master back, as a replica: the slot has one again for the next kill
                await asyncio.to_thread(cluster.revive, old.port)
                assert cluster.master_of(stream).port == replica.port
    finally:
        await r.aclose()
        await asyncio.to_thread(cluster.stop)


async def test_a_batchs_answers_and_report_ride_out_an_outage() -> None:
    """A worker's batch finishing while its Redis is away (a failover takes seconds) is written once
    Redis answers again, its answer and then its report, not dropped for the dispatcher to requeue."""
    server = EmbeddedRedis().start()  # its own: this test kills it
    try:
        async with Bus(server.url) as bus:
            reporter = Reporter(bus, "fo", "r0s0", "m", StagePort(PrefillPort(bus.redis, "fo", kv_ttl_s=0)))
            reply_to = keys.prefill_results_stream("fo", "fd")
            item = PrefillItem(id="q1", tokens=(1, 2), from_layer=0, to_layer=2, reply_to=reply_to)
            outcome = Outcome(item, 2, 0.01, result=_tiny())
            batch = PrefillBatch(run="fo", worker="r0s0", batch_id="b1", items=(item,))
            await asyncio.to_thread(server.kill)
            finishing = asyncio.create_task(reporter.finish_batch(batch, [outcome], preempted=False))
            await asyncio.sleep(1.5)
            assert not finishing.done(), "the writes wait for Redis"
            await asyncio.to_thread(server.restart)
            await asyncio.wait_for(finishing, 30)
            [(_, answer)] = await bus.redis.xrange(reply_to)
            [(_, report)] = await bus.redis.xrange(keys.prefill_reports_stream("fo"))
        got = decode(answer[b"m"])
        assert isinstance(got, PrefillResult) and got.id == "q1" and got.ok
        sent = decode(report[b"m"])
        assert isinstance(sent, PrefillReport) and [p.id for p in sent.progress] == ["q1"]
    finally:
        server.stop()


def _tiny() -> ModelResult:
    kv = [(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4)) for _ in range(2)]
    return ModelResult(token=5, text="x", logprob=-0.1, top=[], prompt_tokens=2, kv=kv)
