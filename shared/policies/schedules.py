"""Pipeline schedules as per-stage lists of actions (pure).

A stage walks its list in order. Sends never block (they are buffered by the bus); a receive
blocks until the matching send has happened. Each iteration ends with the gradient all-reduce
among the stage's DP peers and the optimizer step.

* **GPipe**: all forwards, then all backwards.
* **1F1B** (non-interleaved, PipeDream-flush): stage k runs ``min(p - k - 1, m)`` warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards. Same
  bubble as GPipe, but at most ``p - k`` microbatches' activations are alive at once.

With equal forward and backward times per stage, both have the compute-only bubble fraction
``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(enum.Enum):
    FWD = "fwd"
    BWD = "bwd"
    SEND_ACT = "send_act"  # to stage k + 1
    RECV_ACT = "recv_act"  # from stage k - 1
    SEND_GRAD = "send_grad"  # to stage k - 1
    RECV_GRAD = "recv_grad"  # from stage k + 1
    ALLREDUCE = "allreduce"  # gradients among the stage's DP peers
    STEP = "step"  # optimizer step


@dataclass(frozen=True, slots=True)
class Action:
    op: Op
    mb: int = -1  # microbatch, or -1 for ALLREDUCE / STEP

    def __str__(self) -> str:
        return f"{self.op.value}({self.mb})" if self.mb >= 0 else self.op.value


SCHEDULES = ("gpipe", "1f1b")


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    out = [Action(Op.RECV_ACT, mb)] if stage > 0 else []
    out.append(Action(Op.FWD, mb))
    if stage < stages - 1:
        out.append(Action(Op.SEND_ACT, mb))
    return out


def _backward(stage: int, stages: int, mb: int) -> list[Action]:
    out = [Action(Op.RECV_GRAD, mb)] if stage < stages - 1 else []
    out.append(Action(Op.BWD, mb))
    if stage > 0:
        out.append(Action(Op.SEND_GRAD, mb))
    return out


def gpipe(stage: int, stages: int, microbatches: int) -> tuple[Action, ...]:
    acts: list[Action] = []
    for mb in range(microbatches):
        acts += _forward(stage, stages, mb)
    for mb in range(microbatches):
        acts += _backward(stage, stages, mb)
    return (*acts, Action(Op.ALLREDUCE), Action(Op.STEP))


def one_f_one_b(stage: int, stages: int, microbatches: int) -> tuple[Action, ...]:
    warmup = min(stages - stage - 1, microbatches)
    acts: list[Action] = []
    for mb in range(warmup):
        acts += _forward(stage, stages, mb)
    for i in range(microbatches - warmup):
        acts += _forward(stage, stages, warmup + i)
        acts += _backward(stage, stages, i)
    for mb in range(microbatches - warmup, microbatches):
        acts += _backward(stage, stages, mb)
    return (*acts, Action(Op.ALLREDUCE), Action(Op.STEP))


def schedule(name: str, stage: int, stages: int, microbatches: int) -> tuple[Action, ...]:
    """The action list of `stage` (0-based) in a `stages`-deep pipeline with `microbatches` microbatches."""
    if not 0 <= stage < stages or microbatches < 1:
        raise ValueError(f"no stage {stage} in a {stages}-stage pipeline with {microbatches} microbatches")
    if name == "gpipe":
        return gpipe(stage, stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, microbatches)
    raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")


def compute_bubble_fraction(stages: int, microbatches: int) -> float:
    """The textbook compute-only bubble fraction (equal forward and backward times)."""
    return (stages - 1) / (microbatches + stages - 1)
