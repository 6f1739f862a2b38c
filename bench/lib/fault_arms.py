"""The faults of `bench/faults.py`, one class an arm: how each is injected into a live run and what
the run must do about it (keep going, or recover).

Every arm gets the same `Live` run (a `bubbletea up` under load, a spare worker of our own beside
it) and injects one fault per `inject` call, returning a record: when (`at`, wall clock), the
generation then, what was hit, and what was seen. An arm whose `expect` is "kept" must go on as if
nothing happened: no generation move and the same holder on every slot (`kept`), checked
`CHECK_AFTER_S` after the fault ended. A "recovered" arm loses a slot; `bench/faults.py` times
the run training again from the worker logs.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import Any, Protocol

from bench.lib import dispatcher_watch as watch
from bubbletea.launcher.procs import Proc
from shared.config.spec import ClusterSpec
from shared.control import serving
from shared.control.leases import release_dispatcher_if_held_by
from shared.wire import FIELD, BubbleStart, decode, keys

#: After a fault the run must have gone on without a recovery for this long to count as kept.
CHECK_AFTER_S = 6.0
#: A stall "past the lease": the lease's TTL and two renewals more.
PAST_LEASE_S = keys.LEASE_TTL_MS / 1000 + 2 * keys.LEASE_RENEW_S
#: How long Redis stays down in the Redis arm, and when after its restart a worker is killed.
REDIS_DOWN_S, KILL_AFTER_REDIS_S = 2.0, 3.0
#: A lost host's network comes back this long after it was cut; its worker must be gone within
#: `EXIT_WITHIN_S` of that (its own Redis retries give up after `RIDE_OUT_S`, 30 s).
HEAL_AFTER_S, EXIT_WITHIN_S = 10.0, 45.0
#: The issue's target (66): a killed dispatcher's standby serving within this.
SERVING_TARGET_S = 2.0


class Live(Protocol):
    """What an arm may do to the run (`bench/faults.py` `Run`)."""

    run: str
    spec: ClusterSpec
    rng: random.Random

    async def holders(self) -> dict[tuple[int, int], int]: ...  # slot -> pid of its lease holder
    async def generation(self) -> int: ...
    async def restart_redis(self, down_s: float) -> None: ...
    async def start_worker(self, label: str, *, host: Any = None) -> Proc: ...
    async def start_dispatcher(self, label: str = "dispatcher-second") -> Proc: ...
    async def wait_training_after(self, generation: int, timeout_s: float) -> bool: ...
    def service_pid(self, label: str) -> int: ...
    def label_of(self, pid: int) -> str | None: ...
    def log_count(self, label: str, text: str) -> int: ...
    def redis(self) -> Any: ...


async def _kept(live: Live, generation: int, holders: dict[tuple[int, int], int]) -> dict[str, Any]:
    await asyncio.sleep(CHECK_AFTER_S)
    now_gen, now_holders = await live.generation(), await live.holders()
    return {"kept": now_gen == generation and now_holders == holders, "generation_after": now_gen}


async def _before(live: Live) -> tuple[float, int, dict[tuple[int, int], int]]:
    return time.time(), await live.generation(), await live.holders()


class Arm:
    name = ""
    expect = "kept"  # or "recovered"
    #: Whether the run has a spare of ours beside up's workers (to take a slot over, or to try to).
    spare = True
    #: One line for `--help` and the docs.
    what = ""
    #: Why the arm cannot run on a Redis Cluster (`bench/faults.py --redis-cluster`), as "the arm
    #: ..." goes on; None: it can.
    not_on_cluster: str | None = None

    async def setup(self, live: Live) -> None:
        """Before the first fault (the run is training and serving)."""

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        raise NotImplementedError

    async def teardown(self, live: Live) -> None:
        """After the last fault, before the run stops."""


class Stall(Arm):
    """A slot holder stopped (SIGSTOP) for `seconds`, then let go on (SIGCONT): a GC pause, a
    swap storm, a VM migrated. Below the lease it keeps its slot; past it, the spare takes over."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name, self.seconds = name, seconds
        self.expect = "kept" if seconds < keys.LEASE_TTL_MS / 1000 else "recovered"
        self.what = f"a slot holder SIGSTOPped for {seconds:g} s, then SIGCONT"

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        at, gen, holders = await _before(live)
        slot = live.rng.choice(sorted(holders))
        pid = holders[slot]
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        record = {"at": at, "generation": gen, "slot": list(slot), "pid": pid}
        if self.expect == "kept":
            record |= await _kept(live, gen, holders)
        return record


class LostHost(Arm):
    """A slot holder on a host of its own (`lost_host.LostHost`) whose packets are all dropped:
    no FIN, no reset; its connections stay open in Redis's client list. Each fault starts a worker
    there as a spare, stalls one of `up`'s workers past its lease so that the host's worker takes
    its slot (`up` would hand a slot it frees to its own restarted worker first), then cuts the host
    off; the spare must take the slot within the lease's TTL plus 2 s. `HEAL_AFTER_S` later the
    network comes back (a partition that heals), and the host's worker must stop by itself."""

    name, expect, spare = "lost-host", "recovered", False  # the host's worker is the spare
    what = "a slot holder in its own network namespace whose packets are all dropped (no FIN)"
    not_on_cluster = "puts a worker behind a link the one redis-server listens on, which a cluster's nodes do not"

    def __init__(self, host: Any) -> None:
        self.host = host  # built by bench/faults.py before `up` starts: up's workers bind its root end

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        worker = await live.start_worker(f"stage_worker-host{i}", host=self.host)
        await wait(lambda: any("spare ready" in line for line in worker.tail), 120, f"host worker {i} never ready")
        gen, holders = await live.generation(), await live.holders()
        ours = [pid for pid in holders.values() if pid != worker.proc.pid]
        stopped = live.rng.choice(ours)
        label = live.label_of(stopped) or ""
        ready_before = live.log_count(label, "spare ready")
        # stopped past its lease: the host's worker, the only spare, takes the slot over; up's worker,
        # let go on, finds its slot gone and exits, and up's replacement of it waits as a spare
        os.kill(stopped, signal.SIGSTOP)
        try:
            await asyncio.sleep(PAST_LEASE_S)
        finally:
            os.kill(stopped, signal.SIGCONT)

        async def holds() -> bool:
            return worker.proc.pid in (await live.holders()).values()

        if not await _wait_async(holds, 120) or not await live.wait_training_after(gen, 120):
            raise RuntimeError(f"lost-host {i}: the host's worker never took a slot")
        # up's replacement of the stopped worker is the spare that will take the host's slot over
        await wait(lambda: live.log_count(label, "spare ready") > ready_before, 120, f"lost-host {i}: no spare")
        await asyncio.sleep(3.0)  # a few steps with the host in the pipeline
        at, gen, holders = await _before(live)
        slot = next(s for s, pid in holders.items() if pid == worker.proc.pid)
        await asyncio.to_thread(self.host.cut)

        async def taken() -> bool:
            return (await live.holders()).get(slot) != worker.proc.pid

        took = await _wait_async(taken, 60, poll_s=0.05)
        taken_s = time.time() - at if took else None
        # the partition heals: the host's worker, its slot taken, must stop on its own, having
        # written nothing (its lease is another's: `services/stage_worker/membership/lease.py`)
        await asyncio.sleep(HEAL_AFTER_S)
        await asyncio.to_thread(self.host.restore)
        healed = time.time()
        exited = await _wait_async(lambda: _gone(worker), EXIT_WITHIN_S)
        record = {"at": at, "generation": gen, "slot": list(slot), "pid": worker.proc.pid, "taken_s": taken_s}
        record["exited_after_heal_s"] = round(time.time() - healed, 2) if exited else None
        if not exited:
            worker.proc.kill()
        await worker.proc.wait()
        return record


class DuplicateBatch(Arm):
    """The newest `PrefillBatch` of a slot's fill stream written again, as a retried XADD does."""

    name, what = "duplicate-batch", "a PrefillBatch written twice to a worker's fill stream"

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        r = live.redis()
        at, gen, holders = await _before(live)
        record: dict[str, Any] = {"at": at, "generation": gen, "batch": None}
        for _ in range(200):  # the newest batch of any slot that has one
            d, k = live.rng.choice(sorted(holders))
            newest = await r.xrevrange(keys.fill_stream(live.run, d, k), count=1)
            if newest:
                await r.xadd(keys.fill_stream(live.run, d, k), newest[0][1])
                record |= {"slot": [d, k], "batch": decode(newest[0][1][FIELD]).batch_id}
                break
            await asyncio.sleep(0.05)
        return record | await _kept(live, gen, holders)


class DuplicateAnswer(Arm):
    """An answer written again (a worker's report retried): the newest answered request's result
    through the answer script again, and the newest prefill report appended again."""

    name, what = "duplicate-answer", "an answer and a prefill report written twice"

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        r = live.redis()
        at, gen, holders = await _before(live)
        record: dict[str, Any] = {"at": at, "generation": gen}
        streams = sorted(await r.keys(keys.prefill_results_stream(live.run, "*")))
        newest = await r.xrevrange(streams[0], count=1) if streams else []
        if newest:
            result = decode(newest[0][1][FIELD])
            record |= {
                "request": result.id,
                "answered_again": await serving.answer(r, live.run, result, streams[0].decode()),
            }
        report = await r.xrevrange(keys.prefill_reports_stream(live.run), count=1)
        if report:
            await r.xadd(keys.prefill_reports_stream(live.run), report[0][1])
            record["report_repeated"] = True
        return record | await _kept(live, gen, holders)


class RedisThenKill(Arm):
    """Redis SIGKILLed and started again on its append-only file, then a slot holder SIGKILLed
    `KILL_AFTER_REDIS_S` after, while the run is still settling (lease liveness off: `SETTLE_S`)."""

    name, expect = "redis-then-kill", "recovered"
    what = f"Redis killed and restarted ({REDIS_DOWN_S:g} s down), a worker killed {KILL_AFTER_REDIS_S:g} s after"
    not_on_cluster = "restarts the one redis-server on its append-only file (a master killed: bench/failover.py)"

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        at, gen, holders = await _before(live)
        await live.restart_redis(REDIS_DOWN_S)
        await asyncio.sleep(KILL_AFTER_REDIS_S)
        slot = live.rng.choice(sorted(holders))
        now = await live.holders()
        pid = now.get(slot, holders[slot])
        os.kill(pid, signal.SIGKILL)
        return {"at": at, "generation": gen, "slot": list(slot), "pid": pid, "worker_killed_at": time.time()}


class DispatcherStall(Arm):
    """The run's leading dispatcher SIGSTOPped past the claim time with a second dispatcher beside
    it (a standby: `services/dispatcher/lease.py`): the standby takes the lease over and claims the
    requests the first held; the first, let go on, must step down and schedule none of them."""

    name = "dispatcher-stall"
    what = "the leading dispatcher SIGSTOPped past claim_idle_ms, a standby beside it"

    async def setup(self, live: Live) -> None:
        self.second = await live.start_dispatcher()

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        r = live.redis()
        at, gen, holders = await _before(live)
        seconds = live.spec.bus.claim_idle_ms / 1000 + 3.0
        leader = (await r.get(keys.dispatcher_lease_key(live.run)) or b"").decode()
        pid = int(leader.rpartition("-")[2])
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        after = (await r.get(keys.dispatcher_lease_key(live.run)) or b"").decode()
        record = {"at": at, "generation": gen, "stalled_s": seconds, "leader": leader, "leader_after": after}
        return record | {"taken_over": bool(after) and after != leader} | await _kept(live, gen, holders)


class DispatcherKill(Arm):
    """The run's leading dispatcher SIGKILLed (by its PID, read from the lease's value), a standby
    beside it (issue 66). Each fault measures, from the kill:

    * `takeover_s`: to the lease held by another dispatcher (`keys.dispatcher_lease_key`, looked at
      every `dispatcher_watch.LEASE_POLL_S`);
    * `serving_s`: to the first `PrefillBatch` appended to any of the run's fill streams
      (`keys.fill_stream`, read by XREAD) after the lease was last seen with the killed one: the
      new leader's first dispatch, as a worker receives it. Batches are appended by a script that
      checks the lease first (services/dispatcher/writes.py), so none written after the lease left
      the killed dispatcher is its. Timed by its entry id (Redis's clock: this host's).

    A dead process's lease is released by its supervisor, who saw it exit: `bubbletea up` does so
    for its dispatcher (`_Services.buried`), and the bench for the one it started, the same way
    (`release_dispatcher_if_held_by`, after reaping it); `lease_left_s` records what a death no
    supervisor saw would wait instead (the lease's TTL left at the kill). Then the next standby:
    `up` restarts its own dispatcher (`shared.policies.restarts`), and that one stands by; when the
    killed one was ours, a new one of ours is started. Either way the next kill waits until a live
    dispatcher other than the leader heartbeats as a standby (`standby_ready_s`: from the kill,
    first looked at once the first batch was found)."""

    name = "dispatcher-kill"
    what = "the leading dispatcher SIGKILLed, a standby beside it"

    async def setup(self, live: Live) -> None:
        self.ours: Proc | None = await live.start_dispatcher("dispatcher-standby-0")
        if await watch.standby(live.redis(), live.run, killed=None) is None:
            raise RuntimeError("dispatcher-kill: the second dispatcher never stood by")

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        r = live.redis()
        gen, holders = await live.generation(), await live.holders()
        key = keys.dispatcher_lease_key(live.run)
        standby = await watch.standby(r, live.run, killed=None, timeout_s=0.0)
        leader = (await r.get(key) or b"").decode()
        left_ms = await r.pttl(key)
        pid = int(leader.rpartition("-")[2])
        ours = self.ours if self.ours is not None and self.ours.proc.pid == pid else None
        os.kill(pid, signal.SIGKILL)
        at = time.time()
        record: dict[str, Any] = {"at": at, "generation": gen, "leader": leader, "pid": pid}
        record |= {"killed": "ours" if ours else "up's", "lease_left_s": round(max(left_ms, 0) / 1000, 3)}
        held_last = None
        if ours is not None:  # its supervisor (the bench) saw it die: its lease released, as up does
            await ours.proc.wait()
            self.ours, held_last = None, time.time()
            record["released"] = await release_dispatcher_if_held_by(r, live.run, leader)
        moved = await watch.lease_moved(r, live.run, leader, at, held_last)
        record |= {k: v for k, v in moved.items() if k != "held_last"}
        new_pid = int(moved["new_leader"].rpartition("-")[2]) if moved["new_leader"] else None
        record["by_standby"] = new_pid is not None and new_pid == standby
        par = live.spec.parallelism
        record |= await watch.first_batch(r, live.run, par.pp, par.dp, moved["held_last"], at)
        if ours is not None:  # the killed one was ours: up's leads or stands by; a new one of ours
            self.ours = await live.start_dispatcher(f"dispatcher-standby-{i + 1}")
        ready = await watch.standby(r, live.run, killed=pid)
        record |= {"standby_started": ours is not None, "standby_pid": ready}
        record["standby_ready_s"] = round(time.time() - at, 2) if ready is not None else None
        return record | await _kept(live, gen, holders)


class CancelledFill(Arm):
    """A worker SIGKILLed the moment its pipeline neighbour opens a bubble: the neighbour's fill,
    then computing, is cancelled by the recovery mid-block."""

    name, expect = "cancelled-fill", "recovered"
    what = "a worker killed as its neighbour starts filling a bubble"

    async def inject(self, live: Live, i: int) -> dict[str, Any]:
        r = live.redis()
        gen, holders = await live.generation(), await live.holders()
        stream, last = keys.bubbles_stream(live.run), "$"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = await r.xread({stream: last}, count=10, block=1000)
            for _, entries in got:
                for entry_id, fields in entries:
                    last = entry_id
                    m = decode(fields[FIELD])
                    if isinstance(m, BubbleStart) and m.predicted_ms > 0:
                        peer = (m.replica, m.stage + 1 if m.stage + 1 < live.spec.parallelism.pp else m.stage - 1)
                        pid = holders[peer]
                        os.kill(pid, signal.SIGKILL)
                        at = time.time()
                        return {"at": at, "generation": gen, "slot": list(peer), "pid": pid, "filling": m.worker}
        raise RuntimeError("cancelled-fill: no bubble opened within 30 s")


def _gone(p: Proc) -> bool:
    return p.proc.returncode is not None


async def wait(check: Any, timeout_s: float, why: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(why)
        await asyncio.sleep(0.1)


async def _wait_async(check: Any, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if await result if asyncio.iscoroutine(result) else result:
            return True
        await asyncio.sleep(poll_s)
    return False


def arms(host: Any) -> dict[str, Arm]:
    """Every arm, in the order they run."""
    every: list[Arm] = [
        Stall("stall-0.3s", 0.3),
        Stall("stall-1s", 1.0),
        Stall("stall-past-lease", PAST_LEASE_S),
        LostHost(host),
        DuplicateBatch(),
        DuplicateAnswer(),
        RedisThenKill(),
        DispatcherStall(),
        DispatcherKill(),
        CancelledFill(),
    ]
    return {a.name: a for a in every}


def refused_on_cluster(names: list[str]) -> str | None:
    """Which of the arms `names` cannot run on a Redis Cluster, and why, in one line (None: all can)."""
    every = arms(None)
    bad = [f"the {n} arm {why}" for n in names if n in every and (why := every[n].not_on_cluster)]
    return "; ".join(bad) if bad else None
