"""The analytic pipeline model: the expected timeline of a training run (pure).

Its inputs (`PipelineInputs`: the stages, their DCs, profiled compute times, the WAN links and their
sharing) and its answers (`PipelineResult`: iteration times, each slot's spans, its bubbles and the
bubble fraction): the expected numbers for benchmarks, and the live workers' bubble predictions
before they have history.

The timeline itself is walked by the one engine the simulator runs too
(`shared.policies.pipeline_run.PipelineRun`, each slot driving `shared.policies.walk.SlotWalk`, the
walk the live worker drives): `simulate` is that engine with no bus hops and no serving guest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from shared.policies.spans import Span
from shared.policies.wan import LinkModel

Worker = tuple[int, int]  # (replica, stage)


@dataclass(frozen=True)
class PipelineInputs:
    stages: int
    dp: int
    microbatches: int
    schedule: str
    stage_dc: tuple[str, ...]
    fwd_s: tuple[float, ...]  # per stage, per microbatch
    bwd_s: tuple[float, ...]
    act_bytes: int  # activation (= gradient) bytes of one microbatch between stages
    links: dict[tuple[str, str], LinkModel]  # directed (src DC, dst DC) -> link
    sharing: str = "temporal"
    allreduce_s: tuple[float, ...] = ()  # per stage; empty = 0
    step_s: float = 0.0
    #: The step waits for the pipeline's cross-stage collectives first (the global gradient norm
    #: for clipping, a tied embedding's gradient; `walk.has_step_collectives`): the stages that
    #: finish their backward passes first wait there, a bubble at the step's position, as on a
    #: live worker.
    step_collectives: bool = False


class Bubble(NamedTuple):
    """A slot's wait for its input (a tuple: an 8,192-GPU simulation records ~10^5 an iteration)."""

    replica: int
    stage: int
    iteration: int
    position: int  # index of the blocking action in the stage's action list
    start: float
    length: float


@dataclass
class PipelineResult:
    spans: list[Span]
    bubbles: list[Bubble]
    iteration_ends: list[float]  # when the last worker finished each iteration's step
    workers: int
    inputs: PipelineInputs | None = field(default=None, repr=False)

    @property
    def makespan(self) -> float:
        return self.iteration_ends[-1]

    @property
    def iteration_times(self) -> list[float]:
        return [b - a for a, b in zip([0.0, *self.iteration_ends], self.iteration_ends, strict=False)]

    def bubble_fraction(self) -> float:
        """Share of worker time not spent computing (forward, backward, all-reduce, step)."""
        busy = sum(s.end - s.start for s in self.spans if s.kind != "wait")
        return 1 - busy / (self.workers * self.makespan) if self.makespan > 0 else 0.0

    def predicted_bubble(self, replica: int, stage: int, position: int) -> float:
        """Length of the bubble at a schedule position (0 if the model has none there), from the
        last simulated iteration (steady state)."""
        last = max((b.iteration for b in self.bubbles), default=0)
        for b in self.bubbles:
            if (b.replica, b.stage, b.position, b.iteration) == (replica, stage, position, last):
                return b.length
        return 0.0

    def bubbles_by_slot(self, iteration: int) -> list[dict[int, float]]:
        """Each slot's bubble lengths by schedule position in `iteration` (slot `w` is replica
        w // stages, stage w % stages; needs `inputs`)."""
        assert self.inputs is not None, "a result of PipelineRun carries its inputs"
        stages = self.inputs.stages
        out: list[dict[int, float]] = [{} for _ in range(self.workers)]
        for b in self.bubbles:
            if b.iteration == iteration:
                out[b.replica * stages + b.stage][b.position] = b.length
        return out
