"""A worker's part in its run: join, train, and after a lost peer join again and resume.

The protocol is `recovery.py`'s (generations, the barrier, the resume point); this module drives
one worker through it with its lease, its inbox and its runner, until the run ends, it is told to
stop, or a failure it cannot ride out (raised as `SlotError` naming the slot).
"""

from __future__ import annotations

import asyncio

from services.stage_worker.lease import SlotError, SlotLease
from services.stage_worker.leaving import leave_at_boundary, leave_now
from services.stage_worker.port.transport import FINISH_GRACE_S
from services.stage_worker.recovery import Generations
from services.stage_worker.train.runner import StageRunner
from shared.bus import Consumer
from shared.dataplane import PlaneError
from shared.policies.recovery import FROM_SCRATCH, OWN_CHECKPOINT, Resume, Source, needs_state
from shared.runtime.logs import get_logger

#: How long a worker waits for all its peers to lease their slots.
START_TIMEOUT_S = 180.0
#: What `_join` returns when the generation moved on while it formed: join again (never an iteration).
REJOIN = -1

log = get_logger(__name__)


async def take_part(
    runner: StageRunner,
    inbox: Consumer,
    lease: SlotLease,
    watch: asyncio.Task[None],
    gens: Generations,
    stop: asyncio.Event,
    leave: asyncio.Event | None = None,
) -> None:
    """Join the run, train; after a lost peer, join again and resume, until the end or a stop. Told
    to `leave` (a drain: SIGTERM, `bubbletea drain`), finish the iteration in progress and hand the
    slot over, the run going on (`leaving.py`)."""
    slot, tr = runner.slot, runner.spec.training
    leave = leave if leave is not None else asyncio.Event()
    async with inbox:
        stopping = asyncio.create_task(stop.wait(), name="stop")
        crashed = asyncio.create_task(inbox.crashed.wait(), name="inbox")
        leaving = asyncio.create_task(_first(leave, lease.drain), name="leave")
        try:
            after_loss = False
            while True:
                halt = asyncio.create_task(_first(stop, leave, lease.drain), name="halt")
                try:
                    start = await _join(runner, lease, watch, gens, halt, stop, after_loss=after_loss)
                finally:
                    halt.cancel()
                if start == REJOIN:
                    after_loss = True
                    continue
                if start is None:  # told to stop or leave while waiting for the peers (they may never come)
                    if leaving.done():
                        await leave_now(runner, lease, "before it trained in this generation")
                        return
                    log.info("stopped before training started", slot=slot.name)
                    await lease.mark_stopped(f"slot {slot.name} was stopped before training started")
                    return
                log.info("all slots held; training", slot=slot.name, iterations=tr.iterations, start=start)
                train = asyncio.create_task(runner.run_all(start), name="train")
                lost = asyncio.create_task(lease.peer_lost.wait(), name="lost")
                # a run without checkpoints does not resume: only a lost lease ends it
                watch_generation = gens.moved() if tr.recovers else asyncio.Event().wait()
                moved = asyncio.create_task(watch_generation, name="moved")
                waiting = {train, watch, stopping, crashed, lost, moved}
                while True:
                    done, _ = await asyncio.wait(waiting | {leaving}, return_when=asyncio.FIRST_COMPLETED)
                    if leaving in done:  # at the next step boundary; the pipeline goes on till then
                        runner.leaving = True
                        log.info("asked to leave: finishing the iteration in progress", slot=slot.name)
                        if runner.filler is not None:  # its prefill moves to workers that stay, now
                            runner.filler.leave(f"slot {slot.name} is leaving the run (drained)")
                        leaving = asyncio.create_task(_first(asyncio.Event()), name="left")  # said once
                    if done & waiting:
                        break
                for t in (train, lost, moved):
                    t.cancel()
                await asyncio.gather(train, lost, moved, return_exceptions=True)
                if train in done:
                    train.result()  # re-raise a training error
                    await _finish_sends(runner)
                    await runner.outbox.close()
                    if runner.left_after is not None:
                        await leave_at_boundary(runner, lease, runner.left_after)
                        return
                    await lease.finish()
                    log.info(
                        "training finished",
                        slot=slot.name,
                        iterations=tr.iterations,
                        over_predicted_bubbles=round(runner.predictor.over_predicted_share(), 3),
                    )
                    return
                if watch in done:
                    watch.result()  # raises SlotError naming the slot
                if crashed in done:
                    raise RuntimeError(f"inbox consumer crashed: {inbox.error!r}")
                if stopping in done:
                    log.info("stopped before the end of training", slot=slot.name, iteration=runner.iteration)
                    await lease.mark_stopped(f"slot {slot.name} was stopped at iteration {runner.iteration}")
                    return
                if runner.leaving:  # a peer was lost meanwhile: no boundary to wait for
                    await leave_now(runner, lease, f"while the run recovered at iteration {runner.iteration}")
                    return
                log.warning(
                    "the run pauses to recover: iteration cut short",
                    slot=slot.name,
                    iteration=runner.iteration,
                    generation=gens.current,
                    why="a peer lost its worker" if lost in done else "a replacement joined the run",
                )
                after_loss = True
        finally:
            for t in (stopping, crashed, leaving):
                t.cancel()
            await runner.outbox.close()


async def _first(*events: asyncio.Event) -> None:
    """Until any of `events` is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _finish_sends(runner: StageRunner) -> None:
    """The last sends may still wait for their WAN slot, granted on the inbox: read it until they
    are out, so the peers downstream get their last tensors."""
    if runner.port is not None and not await runner.port.flush(FINISH_GRACE_S):
        log.warning("sends still under way at the end of training", slot=runner.slot.name, waited_s=FINISH_GRACE_S)


async def _join(
    runner: StageRunner,
    lease: SlotLease,
    watch: asyncio.Task[None],
    gens: Generations,
    stopping: asyncio.Task[None],
    stop: asyncio.Event,
    *,
    after_loss: bool,
) -> int | None:
    """Join a new generation and wait for every slot; take the state it resumes from. Returns the
    iteration to train from, or None if told to stop (or leave) meanwhile. `stopping`: a stop, a
    leave or a drain (ends the wait for the slots); `stop`: the run's stop alone (ends the data
    plane's formation too)."""
    slot, tr = runner.slot, runner.spec.training

    def enter(gen: int) -> None:  # before anything of the new generation can arrive
        runner.mailbox.reset()
        runner.enter_generation(gen)

    lease.check_peers = False
    await lease.confirm()  # a holder whose slot was taken meanwhile must not join (SlotError)
    enter(await gens.enter(after_loss=after_loss))
    # the state this worker holds, once the cut-short iteration's last operation is done
    gens.stepped = await runner.in_torch_thread(lambda: runner.trainer.stepped)
    runner.announce_joined()  # while the barrier waits for the others: its first batch gets staged
    timeout = tr.recovery_timeout_s if after_loss else START_TIMEOUT_S
    barrier = asyncio.create_task(gens.barrier(slot, timeout, on_enter=enter), name="barrier")
    await asyncio.wait({barrier, watch, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not barrier.done():
        barrier.cancel()
        await asyncio.gather(barrier, return_exceptions=True)
        if watch.done():
            watch.result()  # our own lease was lost: raises SlotError
        return None  # told to stop
    gen = barrier.result()
    port = runner.port
    if port is not None and port.transport is not None:  # this generation's groups, with every peer
        # A stop of the run calls the formation off: the peers it waits for are stopping too. (Told
        # to leave, it forms: its peers wait for its end of the groups, and it leaves a step later.)
        # So does a move of the generation: a replacement that began the next one just as this
        # barrier passed takes the peers there, and this generation's groups would never form (a
        # worker waited the plane's whole timeout, then failed: issue 62). It joins the new one.
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
            if stop.is_set():
                return None  # told to stop
            log.warning(
                "the run's generation moved on while its groups formed: joining it", slot=slot.name, generation=gen
            )
            return REJOIN
        try:
            forming.result()
        except PlaneError as exc:
            raise SlotError(f"slot {slot.name} could not join the data plane of generation {gen}: {exc}") from None
    store = port if port is not None and port.checkpoints else None
    plan = await gens.resume_point(store.checkpoint_iterations if store is not None else None)
    saved = None
    if (
        plan.source is Source.SCRATCH and runner.resume_from is not None
    ):  # `bubbletea train --resume`, no checkpoint yet
        resume, saved = runner.resume_from
        plan = Resume(resume, Source.CHECKPOINT)
        if store is not None:  # a replacement (started without the save) and its peers resume from it too
            await store.save_checkpoint(resume, saved)
    if after_loss or plan.after != FROM_SCRATCH:
        runner.report_cut_short(gens.stepped, plan)  # before the cut-short iteration's loss is dropped
        await _take_state(runner, plan, saved, gens.stepped)
    lease.peer_lost.clear()
    lease.check_peers = True
    log.info("joined the run", slot=slot.name, generation=gen, resume_after=plan.after, source=str(plan.source))
    return plan.after + 1


async def _take_state(runner: StageRunner, plan: Resume, saved: bytes | None, stepped: int) -> None:
    """This worker's state for the generation's `plan`: kept (it holds the state the run resumes
    from), handed over by a live peer of its stage over the data plane, or a checkpoint's (or the
    initial weights); whatever a cut-short iteration left behind is dropped either way."""
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
            raise SlotError(f"slot {slot.name} could not take its stage's state from replica {source}: {exc}") from None
    elif plan.source is Source.CHECKPOINT and blob is None:
        assert port is not None and port.checkpoints
        blob = await port.load_checkpoint(plan.after)
    if not needs_state(plan, slot.replica, slot.stage, stepped):
        await runner.in_torch_thread(trainer.discard)  # it holds the state the run resumes from
        return
    try:
        await runner.in_torch_thread(trainer.restore, blob, plan.after)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise SlotError(
            f"slot {slot.name} cannot restore the state of iteration {plan.after} of run {runner.run} "
            f"({exc}); it was written for another spec: start a new run id (BUBBLETEA_RUN)"
        ) from None
