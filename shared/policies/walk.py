"""One pipeline slot's walk of its schedule (pure): the one walker every clock drives.

A slot (replica d, stage k) walks the action list of `shared.policies.schedules`, iteration
after iteration. The walk says *what* comes next and *which tensor* a send or a receive names;
the driver brings the clock and the effects:

* the analytic model and the simulator (`shared.policies.pipeline_run`): a virtual clock, compute
  as profiled durations, links as the broker's policy objects;
* the live stage worker (`services/stage_worker/train/runner.py`): the wall clock, real torch, the
  stage's port.

Two steps exist only in the walk, not in the schedule's list:

* ``COLLECTIVES``, before the optimizer ``STEP`` when the pipeline has cross-stage collectives (the
  tied embedding's gradient summed between the first and the last stage; the stages' squared
  gradient norms summed for clipping by the global norm). Every stage of the replica waits there
  for the last one to finish its backward passes: a bubble at the step's position.
* ``END``, after the last action of an iteration, where the driver closes the iteration
  (its telemetry, a checkpoint) before the walk moves on to the next.

Driving it: ``a = walk.current()``, do what ``a`` says, ``walk.advance()``; `current()` is None once
the last iteration has ended. A receive names its tensor with `awaited()`, a send with `sent()`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.policies.schedules import Action, Op

#: A tensor addressed to a slot: (replica, receiving stage, "act" | "grad", iteration, microbatch).
Key = tuple[int, int, str, int, int]


class Phase(enum.Enum):
    """The walk's own steps, beside the schedule's actions."""

    COLLECTIVES = "collectives"
    END = "end"


@dataclass(frozen=True, slots=True)
class WalkStep:
    """A step of the walk that is not one of the schedule's actions (`Phase`); ``mb`` is -1 like
    the schedule's per-iteration actions, so a driver reads ``step.mb`` whatever the step is."""

    op: Phase
    mb: int = -1

    def __str__(self) -> str:
        return self.op.value


COLLECTIVES = WalkStep(Phase.COLLECTIVES)
END = WalkStep(Phase.END)

Step = Action | WalkStep


def has_step_collectives(stages: int, clip_grad_norm: float, tied_embeddings: bool) -> bool:
    """Whether the optimizer step waits for the pipeline's cross-stage collectives: the global
    gradient norm (clipping, with more than one stage) or a tied embedding split across stages."""
    return stages > 1 and (clip_grad_norm > 0 or tied_embeddings)


class SlotWalk:
    """Where one slot is in its schedule. `iterations`: the walk ends after that many (None: never);
    `start`: the first iteration (a resumed run's)."""

    __slots__ = ("_collected", "_n", "actions", "collectives", "iteration", "iterations", "pos", "replica", "stage")

    def __init__(
        self,
        replica: int,
        stage: int,
        actions: tuple[Action, ...],
        *,
        iterations: int | None = None,
        collectives: bool = False,
        start: int = 0,
    ) -> None:
        self.replica, self.stage, self.actions = replica, stage, actions
        self.iterations, self.collectives = iterations, collectives
        self.iteration, self.pos = start, 0
        self._n = len(actions)
        self._collected = False

    def current(self) -> Step | None:
        """What the slot does now (None: the walk is over). `pos` stays the schedule position of
        the action, so COLLECTIVES shares the STEP's position (where its bubble is predicted)."""
        pos = self.pos
        if pos == self._n:
            return END
        if pos == 0 and self.iterations is not None and self.iteration >= self.iterations:
            return None
        a = self.actions[pos]
        if a.op is Op.STEP and self.collectives and not self._collected:
            return COLLECTIVES
        return a

    def advance(self) -> None:
        """The current step is done: move to the next (past END: the next iteration's first)."""
        if self.pos == self._n:
            self.iteration += 1
            self.pos = 0
            self._collected = False
        elif self.collectives and not self._collected and self.actions[self.pos].op is Op.STEP:
            self._collected = True
        else:
            self.pos += 1

    def awaited(self) -> Key:
        """The tensor the current receive waits for."""
        a = self.actions[self.pos]
        return (self.replica, self.stage, "act" if a.op is Op.RECV_ACT else "grad", self.iteration, a.mb)

    def sent(self) -> Key:
        """The tensor the current send puts on its way, as its receiver names it."""
        a = self.actions[self.pos]
        if a.op is Op.SEND_ACT:
            return (self.replica, self.stage + 1, "act", self.iteration, a.mb)
        return (self.replica, self.stage - 1, "grad", self.iteration, a.mb)

    def __repr__(self) -> str:
        return f"r{self.replica}s{self.stage}@{self.current()}"
