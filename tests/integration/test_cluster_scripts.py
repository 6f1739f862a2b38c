"""Every Lua script, MULTI and multi-key command of the code base, run against a real Redis Cluster:
none may raise CROSSSLOT (issue 66). redis-py's cluster client refuses, before sending, a command
whose keys map to several slots, and the server refuses a script or MULTI that touches them: a run's
keys share its hash tag (`keys.run_tag`) so that neither happens.

The list is not written by hand: `sites()` finds, in shared/, services/ and bubbletea/, every
function that calls EVAL, opens a pipeline (a transaction must touch one slot, and redis-py's cluster
pipeline refuses some commands outright: MGET, found so in two places), or sends MGET or a
DEL/EXISTS/UNLINK of several keys. Each must be in `COVERED`, naming the test that runs it against a
cluster: one here (the module-level functions, called with real arguments) or one of the integration
files `make test-cluster` runs on the embedded cluster (the Makefile's ``CLUSTER_SWITCHED``). A new
script or MULTI fails `test_every_script_and_multi_has_a_cluster_case` until it has one."""

from __future__ import annotations

import ast
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis

from bubbletea.launcher import train
from services.dispatcher.takeover import measurement, publish_measurement, publish_snapshot
from services.dispatcher.writes import Writes, execute
from services.prefill_queue.routing import DcRouting
from services.stage_worker.membership.lease import Slot
from services.stage_worker.membership.leaving import run_stopping
from services.stage_worker.port.state import StatePort
from shared.bus import Bus
from shared.bus.connection import command_client
from shared.bus.deadletters import dead_letter
from shared.bus.streams import claim_all, ensure_group
from shared.config.spec import BubbleTea, BusConfig
from shared.control import leases, serving, verdicts
from shared.dataplane import kvstore
from shared.policies.dispatch import DispatchState
from shared.policies.prefill_cost import PrefillCostModel
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.wire import FIELD, PrefillRequest, PrefillResult, encode, keys
from shared.wire.status import RequestStatus, ServingState

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests/integration/test_cluster_scripts.py"

#: Each site (file:function) -> the test that runs it on a cluster.
LEADERSHIP = "tests/integration/test_dispatcher_leadership.py"
DASHBOARD = "tests/integration/test_dashboard.py"
GENERATIONS = "tests/integration/test_recovery_generations.py"
CONVERGE = "test_peers_and_a_replacement_converge_on_one_generation_and_resume_point"
SLOT_LEASE = "tests/integration/test_slot_lease.py"
#: `bubbletea up --redis-cluster` answering a prompt (a worker's sweep of
#: snapshot handles) and stopping: it always runs on a cluster of its own.
FAILOVER = "tests/integration/test_failover.py"  # its tests start clusters of their own
UP = "tests/e2e/test_up_redis_cluster.py::test_up_runs_on_an_embedded_redis_cluster"

#: Each site (file:function) -> the test that runs it on a cluster.
COVERED = {
    "bubbletea/launcher/train.py:_drop_save_keys": f"{HERE}::test_the_launcher_s_save_keys",
    "bubbletea/launcher/train.py:_wait_for_keys": f"{HERE}::test_the_launcher_s_save_keys",
    "services/dispatcher/lease.py:DispatcherLease.step": f"{LEADERSHIP}::test_a_new_leader_takes_its_runs_earlier_"
    "dispatchers_entries_at_once_and_no_other_runs",
    "services/dispatcher/writes.py:execute": f"{HERE}::test_the_dispatcher_s_fenced_writes",
    "services/prefill_queue/routing.py:DcRouting.read": f"{HERE}::test_a_dispatcher_per_datacenter_s_keys",
    "services/prefill_queue/dashboard.py:Hub._look": f"{DASHBOARD}::test_a_lost_lease_then_a_new_holder_is_a_"
    "fault_and_a_takeover",
    "services/stage_worker/membership/generations.py:Generations._join": f"{GENERATIONS}::{CONVERGE}",
    "services/stage_worker/membership/generations.py:Generations.enter": f"{GENERATIONS}::{CONVERGE}",
    "services/stage_worker/membership/generations.py:Generations._look": f"{GENERATIONS}::{CONVERGE}",
    "services/stage_worker/membership/generations.py:Generations._announce": f"{GENERATIONS}::{CONVERGE}",
    "services/stage_worker/membership/lease.py:SlotLease._end": f"{SLOT_LEASE}::test_a_finished_peer_is_not_a_failure",
    "services/stage_worker/membership/lease.py:SlotLease._missing": f"{SLOT_LEASE}::test_barrier_and_peer_loss",
    "services/stage_worker/membership/lease.py:SlotLease._took": f"{SLOT_LEASE}::test_a_spare_takes_the_first_slot_"
    "that_frees_and_stops_when_told",
    "services/stage_worker/membership/lease.py:SlotLease.renew": f"{SLOT_LEASE}::test_renew_fails_once_the_lease_is_"
    "gone_and_a_freed_slot_is_reused",
    "services/stage_worker/membership/leaving.py:run_stopping": f"{HERE}::test_a_worker_s_look_at_who_is_leaving",
    "services/stage_worker/port/prefill.py:PrefillPort._sweep": UP,
    "services/stage_worker/port/state.py:CheckpointStore.iterations": f"{GENERATIONS}::{CONVERGE}",
    "services/stage_worker/port/state.py:CheckpointStore.save": f"{GENERATIONS}::test_a_slot_keeps_its_newest_"
    "two_checkpoints",
    "services/stage_worker/port/state.py:StatePort.hand_over": f"{HERE}::test_the_launcher_s_save_keys",
    "shared/bus/bus.py:Bus.publish_many.xadds": "tests/integration/test_bus.py::test_publish_consume_ack_each_once",
    "shared/bus/deadletters.py:dead_letter": f"{HERE}::test_a_dead_letter_and_its_ack",
    "shared/bus/replicated.py:replicated": f"{FAILOVER}::test_replicated_writes_are_on_the_replica_when_it_returns",
    "shared/bus/streams.py:claim_all": f"{HERE}::test_a_dead_letter_and_its_ack",
    "shared/control/leases.py:look_at_holders": "tests/integration/test_lease_liveness.py::test_a_spare_takes_a_"
    "killed_workers_slot_before_its_lease_expires",
    "shared/control/leases.py:read_slots": f"{HERE}::test_the_lease_scripts",
    "shared/control/leases.py:release_dispatcher_if_held_by": f"{HERE}::test_the_lease_scripts",
    "shared/control/leases.py:release_if_held_by": f"{HERE}::test_the_lease_scripts",
    "shared/control/serving.py:accept": f"{HERE}::test_the_serving_scripts",
    "shared/control/serving.py:answer": f"{HERE}::test_the_serving_scripts",
    "shared/control/serving.py:queue_answer": f"{HERE}::test_the_dispatcher_s_fenced_writes",
    "shared/control/serving.py:claim_idempotency": f"{HERE}::test_a_dispatcher_per_datacenter_s_keys",
    "shared/control/serving.py:find": f"{HERE}::test_a_dispatcher_per_datacenter_s_keys",
    "shared/control/verdicts.py:publish_readiness": f"{HERE}::test_the_serving_scripts",
    "shared/control/serving.py:read_by_client": f"{HERE}::test_the_serving_scripts",
    "shared/control/verdicts.py:readiness": f"{HERE}::test_the_serving_scripts",
    "shared/control/serving.py:reconcile_inflight": f"{HERE}::test_the_serving_scripts",
    "shared/control/verdicts.py:withdraw_readiness": f"{HERE}::test_the_serving_scripts",
    "shared/dataplane/kvstore.py:store_kv_within_budget": f"{HERE}::test_the_kv_budget_script",
    "shared/dataplane/store.py:RedisStore.add.incr": "tests/integration/test_rendezvous_store.py::test_add_wakes_"
    "a_waiter_too",
    "shared/dataplane/store.py:RedisStore.set.write": "tests/integration/test_rendezvous_store.py::test_a_wait_is_"
    "woken_by_the_set_without_polling",
}


#: Sites no cluster case runs, each with why it is safe there.
NOT_RUN = {
    "bubbletea/launcher/train.py:_write_iteration": "writes a save from real stage weights; its multi-key "
    "calls are `_wait_for_keys`'s MGET and a DEL of the same keys, both run in test_the_launcher_s_save_keys",
    "shared/bus/replicated.py:_wait_after_write": "reached only when a failover redirected a pipeline mid-flight "
    "(no test can time that); a one-key SET and a WAIT sent to that key's node: one slot",
}


def _multi_key(call: ast.Call) -> bool:
    """Whether a call is a script, a transaction or a multi-key command (the receiver is not known
    statically: `.eval` needs 2+ arguments or a starred one, as the model's ``lm.eval()`` has none)."""
    if not isinstance(call.func, ast.Attribute):
        return False
    name, args = call.func.attr, call.args
    starred = any(isinstance(a, ast.Starred) for a in args)
    if name in ("eval", "evalsha"):
        return len(args) >= 2 or starred
    if name == "mget":
        return True
    if name == "pipeline":  # a transaction touches one slot; any pipeline may hold a command a cluster's refuses
        return True
    return name in ("delete", "exists", "unlink") and (len(args) > 1 or starred)


def sites() -> set[str]:
    found: set[str] = set()
    for top in ("shared", "services", "bubbletea"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()

            def visit(node: ast.AST, where: list[str], rel: str = rel) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        visit(child, [*where, child.name])
                        continue
                    if isinstance(child, ast.Call) and _multi_key(child) and where:
                        found.add(f"{rel}:{'.'.join(where)}")
                    visit(child, where)

            visit(ast.parse(path.read_text()), [])
    return found


def cluster_switched() -> set[str]:
    """The integration files (or tests) `make test-cluster` runs on the embedded cluster."""
    text = (ROOT / "Makefile").read_text()
    block = re.search(r"^CLUSTER_SWITCHED :=(.*?)(?:\n(?!\s)|\Z)", text, re.S | re.M)
    assert block, "the Makefile's CLUSTER_SWITCHED list"
    return set(re.findall(r"tests/\S+\.py(?:::\w+)?", block.group(1)))


def test_every_script_and_multi_has_a_cluster_case() -> None:
    found = sites()
    assert found - set(COVERED) - set(NOT_RUN) == set(), "a script, MULTI or multi-key command with no cluster case"
    assert (set(COVERED) | set(NOT_RUN)) - found == set(), "a cluster case for a site that is gone"
    switched = cluster_switched()
    for site, test in COVERED.items():
        file, name = test.split("::")
        on_cluster = file in (HERE, FAILOVER, UP.split("::")[0]) or file in switched or test in switched
        assert on_cluster, f"{site}: {test} does not run on the cluster (the Makefile's CLUSTER_SWITCHED)"
        assert re.search(rf"^async def {name}\(|^def {name}\(", (ROOT / file).read_text(), re.M), f"{site}: {test}"


# --- the cases run here ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> AsyncIterator[EmbeddedCluster]:
    c = EmbeddedCluster().start()
    yield c
    c.stop()


@pytest.fixture
async def r(cluster: EmbeddedCluster) -> AsyncIterator[Redis]:
    client = command_client(cluster.url)
    yield client
    await client.aclose()


def run_id(what: str) -> str:
    return f"{what}-{time.time_ns()}"


def request(run: str, rid: str, dc: str | None = None) -> PrefillRequest:
    reply_to = keys.prefill_results_stream(run, "front", dc)
    return PrefillRequest(id=rid, model="m", tokens=(1, 2, 3), submitted=time.time(), reply_to=reply_to)


async def test_the_serving_scripts(r: Redis) -> None:
    run = run_id("serve")
    req = request(run, "q1")
    assert await serving.accept(r, run, req, 10, idempotency_key="k") is True
    assert await serving.accept(r, run, request(run, "q2"), 10, idempotency_key="k") == "q1"  # the key's request
    await ensure_group(r, keys.prefill_requests_stream(run), "dispatcher")
    assert await serving.reconcile_inflight(r, run, "dispatcher") == 1
    done = PrefillResult(id="q1", status=RequestStatus.DONE, token=5, prompt_tokens=3)
    assert await serving.answer(r, run, done, req.reply_to)
    assert not await serving.answer(r, run, done, req.reply_to)  # first answer wins
    found = await serving.lookup(r, run, "q1")
    assert found is not None and found.status is RequestStatus.DONE
    await serving.read_by_client(r, run, ["q1"])
    verdict = verdicts.Readiness(
        run=run, instance="d1", state=ServingState.SERVING, reason="", retry_after_s=1, at=time.time()
    )
    await verdicts.publish_readiness(r, verdict)
    assert [v.instance for v in await verdicts.readiness(r, run)] == ["d1"]
    await verdicts.withdraw_readiness(r, run, "d1")
    assert await verdicts.readiness(r, run) == []


async def test_a_claim_is_on_a_replica_before_the_request_is_accepted(r: Redis, cluster: EmbeddedCluster) -> None:
    """A client's key claimed with a dispatcher per datacenter waits for its replica (WAIT), as the
    accept does: a failover of the run's master cannot take the claim back while its request stands."""
    run = run_id("claim")
    master = cluster.master_of(keys.idempotency_key(run, "k"))
    waits = await wait_calls(master.port)
    assert await serving.claim_idempotency(r, run, "k", "dc-a", "q1") is None
    assert await wait_calls(master.port) == waits + 1


async def wait_calls(port: int) -> int:
    """WAIT commands the node on `port` has answered (INFO commandstats)."""
    node = Redis(host="127.0.0.1", port=port, protocol=2)
    try:
        stats: Any = await node.info("commandstats")
    finally:
        await node.aclose()
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


async def test_a_dispatcher_per_datacenter_s_keys(r: Redis) -> None:
    """A request's whole path with a dispatcher per datacenter, each step on its datacenter's slot:
    a client's key claimed in the run's tag, then accepted in a datacenter's; batched and answered
    by that datacenter's dispatcher (fenced by its lease); found by a GET that names no datacenter;
    the in-flight count reconciled per datacenter; snapshots and measurements published and read."""
    run = run_id("perdc")
    assert await serving.claim_idempotency(r, run, "k1", "dc-b", "b1") is None  # the key is b1's now
    assert await serving.claim_idempotency(r, run, "k1", "dc-a", "other") == ("dc-b", "b1")
    assert await serving.accept(r, run, request(run, "a1", "dc-a"), 10, dc="dc-a")
    assert await serving.accept(r, run, request(run, "b1", "dc-b"), 10, idempotency_key="k1", dc="dc-b")
    # a retry of the claimed key finds its record: the id, nothing enqueued again
    assert await serving.accept(r, run, request(run, "b1", "dc-b"), 10, idempotency_key="k1", dc="dc-b") == "b1"
    assert await serving.accept(r, run, request(run, "b2", "dc-b"), 10, dc="dc-b")
    for dc in ("dc-a", "dc-b"):
        await ensure_group(r, keys.prefill_requests_stream(run, dc), "dispatcher")
    await r.set(keys.prefill_inflight_key(run, "dc-b"), 7)  # a lost decrement: lowered to dc-b's 2 unread
    assert await serving.reconcile_inflight(r, run, "dispatcher", "dc-b") == 2
    assert await serving.reconcile_inflight(r, run, "dispatcher", "dc-c") is None  # no group there
    assert await serving.inflight(r, run, ["dc-a", "dc-b"]) == 3
    # dc-b's dispatcher: a batch to its worker, an answer, the entry acked, fenced by dc-b's lease
    lease, stream = keys.dispatcher_lease_key(run, "dc-b"), keys.prefill_requests_stream(run, "dc-b")
    await r.set(lease, "me", px=10_000)
    got: Any = await r.xreadgroup("dispatcher", "me", {stream: ">"}, count=1)
    ticket = got[0][1][0][0].decode()
    done = PrefillResult(id="b1", status=RequestStatus.DONE, token=1)
    fill = keys.fill_stream(run, 0, 1, "dc-b")
    w = Writes(
        batches=[(fill, b"batch")],
        answers=[(done, request(run, "b1", "dc-b").reply_to)],
        gone=[keys.prefill_snapshot_key(run, "b1", 2, "dc-b")],
        acks=[(stream, "dispatcher", [ticket])],
    )
    assert await execute(r, run, w, (lease, "me"), "dc-b")
    found = await serving.find(r, run, "b1", ["dc-a", "dc-b"])
    assert found is not None and found[0] == "dc-b" and found[1].status is RequestStatus.DONE
    assert await serving.find(r, run, "nope", ["dc-a", "dc-b"]) is None
    await serving.read_by_client(r, run, ["b1"], "dc-b")
    assert 0 < await r.ttl(keys.prefill_request_key(run, "b1", "dc-b")) <= keys.PREFILL_READ_GRACE_S
    await serving.fail_dead_request(r, run, encode(request(run, "a1", "dc-a")), "poison", "dc-a")
    assert (await serving.lookup(r, run, "a1", "dc-a")).status is RequestStatus.FAILED  # type: ignore[union-attr]
    state = DispatchState[PrefillRequest].from_spec(BubbleTea(), 4)
    await publish_measurement(r, run, state, "dc-a")  # not measured yet: nothing written
    await publish_snapshot(r, run, state, "dc-a", ready=True)
    routing = DcRouting(run, ["dc-a", "dc-b"], PrefillCostModel())
    await routing.read(r)
    assert [s.dc for s in routing.router.view(time.time())] == ["dc-a"]  # dc-b has published nothing
    assert await measurement(r, run, "dc-a") is None  # not measured yet: nothing to take over


async def test_the_dispatcher_s_fenced_writes(r: Redis) -> None:
    """A batch, the dispatcher's answers and its acks in one round trip, fenced by its lease."""
    run = run_id("writes")
    lease = keys.dispatcher_lease_key(run)
    await r.set(lease, "me", px=10_000)
    req = request(run, "w1")
    assert await serving.accept(r, run, req, 10)
    stream = keys.prefill_requests_stream(run)
    await ensure_group(r, stream, "dispatcher")
    got: Any = await r.xreadgroup("dispatcher", "me", {stream: ">"}, count=1)
    ticket = got[0][1][0][0].decode()
    failed = PrefillResult(id="w1", status=RequestStatus.FAILED, error="no bubble")
    fill = keys.fill_stream(run, 0, 0)
    w = Writes(batches=[(fill, b"batch")], answers=[(failed, req.reply_to)], acks=[(stream, "dispatcher", [ticket])])
    assert await execute(r, run, w, (lease, "me"))
    assert await r.xlen(fill) == 1 and (await serving.lookup(r, run, "w1")) is not None
    assert int((await r.xpending(stream, "dispatcher"))["pending"]) == 0
    # fenced with no answer: one script; unfenced (no lease): a plain pipeline, spent snapshots deleted
    snaps = [keys.prefill_snapshot_key(run, "w1", layer) for layer in (1, 2)]
    for k in snaps:
        await r.set(k, "host:1")
    assert await execute(r, run, Writes(batches=[(fill, b"b2")], gone=snaps[:1]), (lease, "me"))
    assert await execute(r, run, Writes(batches=[(fill, b"b3")], answers=[(failed, req.reply_to)], gone=snaps))
    assert await r.xlen(fill) == 3 and await r.exists(*snaps) == 0


async def test_a_dead_letter_and_its_ack(r: Redis, cluster: EmbeddedCluster) -> None:
    run = run_id("dead")
    stream = keys.prefill_requests_stream(run)
    await ensure_group(r, stream, "g")
    await r.xadd(stream, {FIELD: b"poison"})
    got: Any = await r.xreadgroup("g", "a", {stream: ">"}, count=1)
    entry = got[0][1][0][0].decode()
    assert await claim_all(r, stream, "g", "b") == 1  # b takes what a held
    assert await dead_letter(r, stream, "g", "b", entry, b"poison", "undecodable", 1)
    assert await r.xlen(keys.run_dead_letter_stream(run)) == 1
    async with Bus(cluster.url, BusConfig()) as bus:  # and an untagged stream's, in its own slot
        c = bus.consumer("plain", "g", {PrefillRequest: _never})
        await ensure_group(bus.redis, "plain", "g")
        await bus.redis.xadd("plain", {FIELD: b"poison"})
        async with c:
            deadline = time.monotonic() + 30
            while c.stats.dead_lettered < 1:
                assert time.monotonic() < deadline
                await bus.redis.xread({keys.dead_letter_stream("plain"): "0"}, block=100)


async def _never(d: Any) -> None:
    raise AssertionError("an undecodable entry reaches no handler")


async def test_the_lease_scripts(r: Redis) -> None:
    run = run_id("lease")
    await r.set(keys.lease_key(run, 0, 1), "w1", px=10_000)
    views = await leases.read_slots(r, run, pp=2, dp=1)
    assert [v.held for v in views] == [False, True]
    assert not await leases.release_if_held_by(r, run, 0, 1, "someone-else")
    assert await leases.release_if_held_by(r, run, 0, 1, "w1")
    await r.set(keys.dispatcher_lease_key(run), "d1", px=10_000)
    assert await leases.release_dispatcher_if_held_by(r, run, "d1")


async def test_the_kv_budget_script(r: Redis, cluster: EmbeddedCluster) -> None:
    """The budget script on the run's slot; a cache stored is on a replica (WAIT) before the answer
    naming it, perhaps on another master (a datacenter's tag), is written."""
    run = run_id("kv")
    waits = await wait_calls(cluster.master_of(keys.kv_cache_key(run, "q")).port)
    stored = await kvstore.store_kv_within_budget(r, run, "q", b"x" * 100, 30, 1_000, time.time())
    assert stored.key == keys.kv_cache_key(run, "q")
    assert await wait_calls(cluster.master_of(stored.key).port) == waits + 1
    refused = await kvstore.store_kv_within_budget(r, run, "q2", b"x" * 1_000, 30, 1_000, time.time())
    assert refused.key == "" and refused.used == 100


async def test_a_worker_s_look_at_who_is_leaving(r: Redis) -> None:
    """`run_stopping` reads the stop mark, the leaving marks and the leases of every slot at once."""
    run = run_id("leave")
    slots = [Slot(replica=0, stage=k) for k in range(2)]
    await r.set(keys.run_stop_key(run), "1", ex=60)
    runner = SimpleNamespace(bus=SimpleNamespace(redis=r), run=run)  # what it reads of a runner: plain values
    assert await run_stopping(runner, SimpleNamespace(all_slots=slots))  # type: ignore[arg-type]


async def test_the_launcher_s_save_keys(r: Redis, cluster: EmbeddedCluster, tmp_path: Path) -> None:
    """A worker hands its state over (`StatePort.hand_over`); the launcher waits for every stage's,
    writes the save and drops the keys (`_wait_for_keys`, `_write_iteration`, `_drop_save_keys`)."""
    run = run_id("save")
    port = StatePort(redis=r, run=run, slot=Slot(replica=0, stage=0), state_dir=tmp_path)
    await port.hand_over(3, b"weights", b"state")
    async with Bus(cluster.url, BusConfig()) as bus:
        wanted = [keys.weights_key(run, 3, 0), keys.train_state_key(run, 3, 0)]
        paths = await train._wait_for_keys(bus, [], wanted, "the save")
        assert [Path(p.decode()).name for p in paths] == ["weights-s0.safetensors", "trainstate-s0.safetensors"]
        await r.set(keys.save_request_key(run), "1")
        await train._drop_save_keys(bus, run)
        assert await r.exists(*wanted) == 0 and not await r.exists(keys.save_request_key(run))
