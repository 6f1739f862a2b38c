"""A worker's part in its run: join, train, and after a lost peer join again and resume.

The protocol is `generations.py`'s (generations, the barrier, the resume point); `joining.py` does
one join. This module is the shell of `shared.policies.membership_moves`: it waits for the first
event, asks the policy for the next move, logs it and executes it, until the run ends, the worker
is told to stop or to leave, or a failure it cannot ride out (raised as `SlotError` naming the slot).

Tests: the policy, tests/unit/test_membership_moves.py; the shell, tests/e2e/test_worker_recovery.py,
test_drain.py, test_worker_failure.py.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

from services.stage_worker.membership.generations import Generations
from services.stage_worker.membership.joining import first_of, join, reset_runtime
from services.stage_worker.membership.lease import SlotError, SlotLease
from services.stage_worker.membership.leaving import leave_at_boundary, leave_now
from services.stage_worker.port.transport import FINISH_GRACE_S
from services.stage_worker.train.runner import StageRunner
from shared.bus import Consumer
from shared.policies.membership_moves import FINAL, Decision, Event, Move, Phase, Seen, next_move
from shared.runtime.logs import get_logger

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
    leave = leave if leave is not None else asyncio.Event()
    member = gens.member
    gens.on_enter = partial(reset_runtime, runner)
    async with inbox:
        part = _Part(runner, inbox, lease, watch, gens, stop, leave)
        try:
            seen = await part.join()
            while True:
                decision = next_move(member, seen, time.monotonic())
                phase = member.phase
                _log(runner, phase, member.generation, decision)
                member.apply(decision)
                if decision.move in FINAL:
                    await part.end_training()
                    await _end(part, decision, phase)
                    return
                seen = await _go_on(part, decision, seen)
        finally:
            await part.close()
            await runner.outbox.close()


async def _go_on(part: _Part, decision: Decision, seen: Seen) -> Seen:
    """Execute a move that the part goes on after; returns what ended the next wait."""
    runner = part.runner
    match decision.move:
        case Move.JOIN:
            await part.end_training()
            return await part.join()
        case Move.TRAIN:
            part.train(decision.start)
        case Move.FINISH_ITERATION:  # at the next step boundary; the pipeline goes on till then
            runner.leaving = True
            if runner.filler is not None:  # its prefill moves to workers that stay, now
                runner.filler.leave(f"slot {runner.slot.name} is leaving the run (drained)")
            part.said_leaving()
            rest = seen.without({Event.TOLD_TO_LEAVE})
            if rest.events:  # what came with it is decided next
                return rest
    return await part.first()


async def _end(part: _Part, decision: Decision, phase: Phase) -> None:
    """Execute a final move (`FINAL`): the training's tasks are over."""
    runner, lease = part.runner, part.lease
    slot = runner.slot.name
    match decision.move:
        case Move.FINISH | Move.HAND_OVER:
            await _finish_sends(runner)
            await runner.outbox.close()
            if decision.left_after is not None:
                await leave_at_boundary(runner, lease, decision.left_after)
            else:
                await lease.finish()
        case Move.LEAVE_NOW:
            when = f"while the run recovered at iteration {runner.iteration}"
            await leave_now(runner, lease, "before it trained in this generation" if phase is Phase.JOINING else when)
        case Move.STOP:
            when = "before training started" if phase is Phase.JOINING else f"at iteration {runner.iteration}"
            await lease.mark_stopped(f"slot {slot} was stopped {when}")
        case Move.FAIL:
            part.raise_failure(decision)


class _Part:
    """One worker's part: what the moves act on, and the tasks it races while it trains, each named
    by the event its end means. The lease's watch, the stop, the inbox's crash and the leave last
    the whole part (the leave until it is said once); the training, a peer's loss and the
    generation's move last one generation's training."""

    def __init__(
        self,
        runner: StageRunner,
        inbox: Consumer,
        lease: SlotLease,
        watch: asyncio.Task[None],
        gens: Generations,
        stop: asyncio.Event,
        leave: asyncio.Event,
    ) -> None:
        self.runner, self.inbox, self.lease, self.watch, self.gens = runner, inbox, lease, watch, gens
        self.stop, self.leave = stop, leave
        self.leaving = asyncio.create_task(first_of(leave, lease.drain), name="leave")
        self.lasting: dict[asyncio.Task[Any], Event] = {
            watch: Event.LEASE_LOST,
            asyncio.create_task(stop.wait(), name="stop"): Event.STOPPED,
            asyncio.create_task(inbox.crashed.wait(), name="inbox"): Event.INBOX_CRASHED,
            self.leaving: Event.TOLD_TO_LEAVE,
        }
        self.training: dict[asyncio.Task[Any], Event] = {}
        self.trainer: asyncio.Task[None] | None = None

    async def join(self) -> Seen:
        """Join a new generation (`joining.py:join`)."""
        return await join(self.runner, self.lease, self.watch, self.gens, self.stop, self.leave)

    def train(self, start: int) -> None:
        """Train from iteration `start`, watching for a lost peer and a move of the generation."""
        self.trainer = asyncio.create_task(self.runner.run_all(start), name="train")
        # a run without checkpoints does not resume: only a lost lease ends it
        moved = self.gens.moved() if self.runner.spec.training.recovers else asyncio.Event().wait()
        self.training = {
            self.trainer: Event.TRAINED,
            asyncio.create_task(self.lease.peer_lost.wait(), name="lost"): Event.PEER_LOST,
            asyncio.create_task(moved, name="moved"): Event.MOVED,
        }

    async def first(self) -> Seen:
        """Every event found done when the first one is."""
        waiting = {**self.lasting, **self.training}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        events = {waiting[t] for t in done}
        if self.trainer in done and self.trainer.exception() is not None:
            events.discard(Event.TRAINED)
            events.add(Event.TRAINING_FAILED)
        return Seen(frozenset(events), left_after=self.runner.left_after)

    def said_leaving(self) -> None:
        """The leave is answered once: it no longer ends a wait."""
        self.lasting.pop(self.leaving, None)

    async def end_training(self) -> None:
        """Cancel this generation's training (a cut-short iteration) and its watchers, and wait."""
        tasks, self.training = list(self.training), {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def raise_failure(self, decision: Decision) -> None:
        """Raise the failure a FAIL names: its task's own error, or the join's as a `SlotError`."""
        match decision.cause:
            case Event.TRAINING_FAILED if self.trainer is not None:
                self.trainer.result()
            case Event.LEASE_LOST:
                self.watch.result()  # a lost lease or a peer stopped: SlotError naming the slot
            case Event.INBOX_CRASHED:
                raise RuntimeError(f"inbox consumer crashed: {self.inbox.error!r}")
        raise SlotError(decision.error or f"slot {self.runner.slot.name}: {decision.why}")

    async def close(self) -> None:
        """Cancel what is still waited on (never the lease's watch: the worker's own) and wait."""
        tasks = [t for t in (*self.lasting, self.leaving, *self.training) if t is not self.watch]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _log(runner: StageRunner, phase: Phase, generation: int, decision: Decision) -> None:
    """One line per decision, its why as the message."""
    tr = runner.spec.training
    fields: dict[str, Any] = {"slot": runner.slot.name, **decision.fields(), "generation": generation}
    if phase is Phase.TRAINING:
        fields["iteration"] = runner.iteration
    match decision.move:
        case Move.TRAIN:
            fields.update(iterations=tr.iterations, start=decision.start)
        case Move.FINISH:
            fields.update(
                iterations=tr.iterations, over_predicted_bubbles=round(runner.predictor.over_predicted_share(), 3)
            )
        case Move.HAND_OVER:
            fields["left_after"] = decision.left_after
    warn = decision.move in (Move.FAIL, Move.JOIN)  # a failure, or a recovery
    (log.warning if warn else log.info)(decision.why, **fields)


async def _finish_sends(runner: StageRunner) -> None:
    """The last sends may still wait for their WAN slot, granted on the inbox: read it until they
    are out, so the peers downstream get their last tensors."""
    if runner.port is not None and not await runner.port.flush(FINISH_GRACE_S):
        log.warning("sends still under way at the end of training", slot=runner.slot.name, waited_s=FINISH_GRACE_S)
