"""One join of a worker to its run's generation, up to its commit point; what ended it, as a value.

A join enters a new generation (its runtime state reset as it does: `reset_runtime`), waits at the
barrier for every slot, forms the generation's data-plane groups and reads the resume plan. Then
the **commit point** (`_commit`): the plan becomes this worker's state (the cut-short iteration
reported or dropped, the state kept, restored or taken from a peer) and its lease checks its peers
again. A failure on the way is a value (`Event.JOIN_FAILED` with why), which `take_part.py`'s
policy turns into a raise; nothing after a failure takes effect.

Tests: tests/e2e/test_worker_recovery.py, test_recovery_formation.py, test_worker_failure.py.
"""

from __future__ import annotations

import asyncio

from services.stage_worker.membership.generations import Generations
from services.stage_worker.membership.lease import SlotError, SlotLease
from services.stage_worker.train.runner import StageRunner
from shared.dataplane import PlaneError
from shared.policies.membership_moves import Event, Membership, Seen
from shared.policies.recovery import FROM_SCRATCH, OWN_CHECKPOINT, Resume, Source, needs_state
from shared.runtime.logs import get_logger

#: How long a worker waits for all its peers to lease their slots.
START_TIMEOUT_S = 180.0

log = get_logger(__name__)


def reset_runtime(runner: StageRunner, generation: int) -> None:
    """The one reset of a worker's runtime state, as it enters `generation` (`Generations.on_enter`),
    before it says it joined, so whatever of the new generation arrives is kept: the mailbox's
    tensors and waiters, and the runner's generation, unsent spans and transfers under way. The
    trainer's state waits for the resume plan (`_commit`)."""
    runner.mailbox.reset()
    runner.enter_generation(generation)


async def first_of(*events: asyncio.Event) -> None:
    """Until any of `events` is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def join(
    runner: StageRunner,
    lease: SlotLease,
    watch: asyncio.Task[None],
    gens: Generations,
    stop: asyncio.Event,
    leave: asyncio.Event,
) -> Seen:
    """Join a new generation (after a loss if the record says so), wait for every slot, take the
    state it resumes from. Returns what ended the join: JOINED (with the iteration to train from),
    HALTED (a stop, a leave or a drain came first; TOLD_TO_LEAVE beside it for the latter two),
    MOVED (the generation moved on while its groups formed), LEASE_LOST or JOIN_FAILED."""
    member, slot, tr = gens.member, runner.slot, runner.spec.training
    lease.check_peers = False
    try:
        await lease.confirm()  # a holder whose slot was taken meanwhile must not join
    except SlotError as exc:
        return Seen.of(Event.JOIN_FAILED, error=str(exc))
    await gens.enter(after_loss=member.after_loss)  # resets the runtime state (`on_enter`)
    # the state this worker holds, once the cut-short iteration's last operation is done
    member.stepped = await runner.in_torch_thread(lambda: runner.trainer.stepped)
    runner.announce_joined()  # while the barrier waits for the others: its first batch gets staged
    timeout = tr.recovery_timeout_s if member.after_loss else START_TIMEOUT_S
    barrier = asyncio.create_task(gens.barrier(slot, timeout), name="barrier")
    halt = asyncio.create_task(first_of(stop, leave, lease.drain), name="halt")
    try:
        await asyncio.wait({barrier, watch, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
    if not barrier.done():
        barrier.cancel()
        await asyncio.gather(barrier, return_exceptions=True)
        return Seen.of(Event.LEASE_LOST) if watch.done() else _halted(leave, lease)
    try:
        gen = barrier.result()
    except SlotError as exc:  # timed out waiting for a slot
        return Seen.of(Event.JOIN_FAILED, error=str(exc))
    formed = await _form(runner, gens, gen, stop, leave, lease)
    if formed is not None:
        return formed
    port = runner.port
    store = port if port is not None and port.checkpoints else None
    plan = await gens.resume_point(store.checkpoint_iterations if store is not None else None)
    saved = None
    if plan.source is Source.SCRATCH and runner.resume_from is not None:  # `train --resume`, no checkpoint yet
        resume, saved = runner.resume_from
        plan = Resume(resume, Source.CHECKPOINT)
        if store is not None:  # a replacement (started without the save) and its peers resume from it too
            await store.save_checkpoint(resume, saved)
    return await _commit(runner, lease, member, plan, saved)


def _halted(leave: asyncio.Event, lease: SlotLease) -> Seen:
    told = leave.is_set() or lease.drain.is_set()
    return Seen.of(Event.HALTED, *([Event.TOLD_TO_LEAVE] if told else []))


async def _form(
    runner: StageRunner,
    gens: Generations,
    gen: int,
    stop: asyncio.Event,
    leave: asyncio.Event,
    lease: SlotLease,
) -> Seen | None:
    """This generation's data-plane groups, with every peer (None: formed, or no transport).

    A stop of the run calls the formation off: the peers it waits for are stopping too. (Told to
    leave, it forms: its peers wait for its end of the groups, and it leaves a step later.) So does
    a move of the generation: a replacement that began the next one just as this barrier passed
    takes the peers there, and this generation's groups would never form (a worker waited the
    plane's whole timeout, then failed: issue 62). It joins the new one."""
    port = runner.port
    if port is None or port.transport is None:
        return None
    forming = asyncio.create_task(port.form(gen), name="form")
    stopped = asyncio.create_task(stop.wait(), name="stopped")
    moved = asyncio.create_task(gens.moved(), name="moved")
    await asyncio.wait({forming, stopped, moved}, return_when=asyncio.FIRST_COMPLETED)
    for t in (stopped, moved):
        t.cancel()
    await asyncio.gather(stopped, moved, return_exceptions=True)
    if not forming.done():
        forming.cancel()
        await asyncio.gather(forming, return_exceptions=True)
        return _halted(leave, lease) if stop.is_set() else Seen.of(Event.MOVED)
    try:
        forming.result()
    except PlaneError as exc:
        error = f"slot {runner.slot.name} could not join the data plane of generation {gen}: {exc}"
        return Seen.of(Event.JOIN_FAILED, error=error)
    return None


async def _commit(runner: StageRunner, lease: SlotLease, member: Membership, plan: Resume, saved: bytes | None) -> Seen:
    """The commit point: the generation's resume `plan` becomes this worker's state, and its lease
    checks the peers again. JOINED with the iteration to train from; or JOIN_FAILED with why, and
    the lease's check of its peers stays off (the worker fails)."""
    if member.after_loss or plan.after != FROM_SCRATCH:
        runner.report_cut_short(member.stepped, plan)  # before the cut-short iteration's loss is dropped
        error = await _take_state(runner, plan, saved, member.stepped)
        if error is not None:
            return Seen.of(Event.JOIN_FAILED, error=error)
    lease.peer_lost.clear()
    lease.check_peers = True
    log.info(
        "joined the run",
        slot=runner.slot.name,
        generation=member.generation,
        resume_after=plan.after,
        source=str(plan.source),
    )
    return Seen.of(Event.JOINED, start=plan.after + 1)


async def _take_state(runner: StageRunner, plan: Resume, saved: bytes | None, stepped: int) -> str | None:
    """This worker's state for the generation's `plan`: kept (it holds the state the run resumes
    from), handed over by a live peer of its stage over the data plane, or a checkpoint's (or the
    initial weights); whatever a cut-short iteration left behind is dropped either way. Returns
    why it could not (None: it took it)."""
    slot, port, trainer = runner.slot, runner.port, runner.trainer
    blob = saved
    source = plan.source_of(slot.stage)
    if plan.source is Source.PEERS and source == OWN_CHECKPOINT:  # no live peer has it: this slot's own file
        assert port is not None and port.checkpoints
        blob = await port.load_checkpoint(plan.after)
    elif plan.source is Source.PEERS and source is not None:  # some worker of this stage lacks it
        assert port is not None
        mine = await runner.in_torch_thread(trainer.checkpoint) if slot.replica == source else None
        try:
            blob = await port.share_state(mine, source)
        except PlaneError as exc:
            return f"slot {slot.name} could not take its stage's state from replica {source}: {exc}"
    elif plan.source is Source.CHECKPOINT and blob is None:
        assert port is not None and port.checkpoints
        blob = await port.load_checkpoint(plan.after)
    if not needs_state(plan, slot.replica, slot.stage, stepped):
        await runner.in_torch_thread(trainer.discard)  # it holds the state the run resumes from
        return None
    try:
        await runner.in_torch_thread(trainer.restore, blob, plan.after)
    except (KeyError, RuntimeError, ValueError) as exc:
        return (
            f"slot {slot.name} cannot restore the state of iteration {plan.after} of run {runner.run} "
            f"({exc}); it was written for another spec: start a new run id (BUBBLETEA_RUN)"
        )
    return None
