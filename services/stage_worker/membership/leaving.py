"""A worker that leaves the run on purpose while the run goes on: a drain (SIGTERM from an
orchestrator evicting its pod, `bubbletea drain SLOT`).

The worker finishes the iteration in progress, its step included (`StageRunner.leaving`), so every
stage holds the state after that step; its prefill is handed back as the worker closes (the fill
executor's `close`). Then:

* **More than one slot told to leave at once** (compose down, scancel, a deleted StatefulSet: SIGTERM
  to every worker of a job or a datacenter), or the run marked stopping (every launcher marks it
  before it stops its services): the whole run stops, as it always did: the slot's end says
  `stopped`, and peers stop quietly. A drain is one worker at a time (a PodDisruptionBudget of
  one keeps Kubernetes to that; `bubbletea drain` two slots at once stops the run).
* **Otherwise a drain**: with one replica (no live peer holds this stage's state) the worker first
  writes its state as a checkpoint of that iteration, then marks its slot `left` and releases it.
  Its peers notice within a lease renewal and recover (docs/architecture.md, "A lost worker"): a
  spare or a replacement takes the slot and the stage's state from a live peer, or from that
  checkpoint; nothing is trained twice. The worker exits 0.

Tests: tests/e2e/test_drain.py; the rules, tests/unit/test_recovery.py.
"""

from __future__ import annotations

import asyncio
import time

from services.stage_worker.membership.lease import SlotLease
from services.stage_worker.train.runner import StageRunner
from shared.policies.recovery import still_leaving, whole_run_stops
from shared.runtime.logs import get_logger
from shared.wire import keys

log = get_logger(__name__)

#: At the step boundary, how long a leaving worker looks for other slots leaving too (a whole job
#: stopped: each worker's SIGTERM came within this of the others'; each said so as it came).
QUORUM_S = 0.3


#: How long a worker stopped by SIGTERM asks Redis whether it is to leave or stop (a quick answer
#: from a live Redis; none from one that died with its launcher: then it stops).
ASK_S = 2.0


async def told_to_leave(runner: StageRunner, holder: str) -> None:
    """Say this slot was told to leave (as the signal comes, so peers stopped together see it):
    its key names the holder told, and counts while that holder keeps the slot (`still_leaving`)."""
    await runner.bus.redis.set(keys.leaving_key(runner.run, runner.slot.name), holder, ex=keys.LEASE_END_TTL_S)


async def run_stopping(runner: StageRunner, lease: SlotLease) -> bool:
    """Whether the whole run is being stopped: marked so, or more than one slot leaving at once (every
    slot, in a run of one)."""
    r = runner.bus.redis
    slots = lease.all_slots
    deadline = time.monotonic() + QUORUM_S
    while True:
        # one round trip of single-key GETs (redis-py refuses MGET in a Redis Cluster's pipeline)
        async with r.pipeline(transaction=False) as pipe:
            pipe.exists(keys.run_stop_key(runner.run))
            for s in slots:
                pipe.get(keys.leaving_key(runner.run, s.name))
            for s in slots:
                pipe.get(keys.lease_key(runner.run, s.replica, s.stage))
            marked, *got = await pipe.execute()
        told, held = got[: len(slots)], got[len(slots) :]
        leaving = still_leaving(told, held)
        if whole_run_stops(marked_stopping=bool(marked), leaving=leaving, slots=len(slots)):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.1)  # set members: there is nothing to block on


async def leave_at_boundary(runner: StageRunner, lease: SlotLease, after: int) -> None:
    """The iteration `after` is done, its step too: stop the run, or hand the slot over."""
    slot = runner.slot
    if await run_stopping(runner, lease):
        log.info("the run is being stopped, not this worker drained: the run stops", slot=slot.name, iteration=after)
        await lease.mark_stopped(f"slot {slot.name} was stopped at iteration {after}")
        return
    port = runner.port
    if runner.spec.parallelism.dp == 1 and port is not None and port.checkpoints:
        # no live peer holds this stage's state: the replacement takes it from this file
        await port.save_checkpoint(after, await runner.in_torch_thread(runner.trainer.checkpoint))
    await _hand_over(runner, lease, f"slot {slot.name} left the run after iteration {after} (drained)")


async def leave_now(runner: StageRunner, lease: SlotLease, when: str) -> None:
    """Told to leave outside a step boundary (waiting for peers, or a recovery under way)."""
    if await run_stopping(runner, lease):
        await lease.mark_stopped(f"slot {runner.slot.name} was stopped {when}")
        return
    await _hand_over(runner, lease, f"slot {runner.slot.name} left the run {when} (drained)")


async def _hand_over(runner: StageRunner, lease: SlotLease, reason: str) -> None:
    await runner.bus.redis.delete(keys.leaving_key(runner.run, runner.slot.name))
    await lease.leave(reason)
    log.info("left the run; its slot goes to a spare or a replacement", slot=runner.slot.name, reason=reason)
