"""Stage placement: which datacenter runs each pipeline stage.

`place` is Atlas's; `round_robin` is the naive placement it is compared against (docs/paper.md).
Both return a `Placement`; `shared.policies.pipeline_plan.placement_of` picks one by the spec's
``parallelism.placement``. Which layers each stage runs is the model's split
(`shared.model.shape.stage_layer_ranges`).

Rule (Atlas): sort DCs by GPUs, largest first (ties by name, for determinism); each DC takes
``floor(gpus / (TP * DP))`` *consecutive* stages until every stage is placed. A stage's whole DP
group (and its TP shards) lives inside one DC, so only pipeline activations and gradients cross
the WAN, and consecutive stages together keep the number of WAN hops small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PlacementError(ValueError):
    """The cluster cannot hold the requested parallelism; the message says how much is missing."""


@dataclass(frozen=True)
class Placement:
    #: stage_dc[k] is the datacenter of pipeline stage k.
    stage_dc: tuple[str, ...]
    dp: int
    tp: int

    @property
    def stages(self) -> int:
        return len(self.stage_dc)

    def hops(self) -> list[tuple[int, str, str]]:
        """Cross-DC pipeline hops as (stage k, DC of k, DC of k+1) for each k whose successor is elsewhere."""
        return [(k, a, b) for k, (a, b) in enumerate(zip(self.stage_dc, self.stage_dc[1:], strict=False)) if a != b]

    def gpus_used(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for dc in self.stage_dc:
            used[dc] = used.get(dc, 0) + self.dp * self.tp
        return used


def place(datacenters: Sequence[tuple[str, int]], pp: int, dp: int, tp: int) -> Placement:
    """Place `pp` stages, each needing ``dp * tp`` GPUs inside one DC, over (name, gpus) datacenters."""
    if pp < 1 or dp < 1 or tp < 1:
        raise PlacementError(f"pp, dp and tp must be at least 1 (got pp={pp}, dp={dp}, tp={tp})")
    per_stage = dp * tp
    order = sorted(datacenters, key=lambda d: (-d[1], d[0]))
    stage_dc: list[str] = []
    for name, gpus in order:
        take = min(gpus // per_stage, pp - len(stage_dc))
        stage_dc.extend([name] * take)
        if len(stage_dc) == pp:
            return Placement(tuple(stage_dc), dp, tp)
    fits = len(stage_dc)
    missing_stages = pp - fits
    raise PlacementError(
        f"cannot place {pp} pipeline stages of {per_stage} GPUs each (DP={dp} x TP={tp}, a stage's group stays "
        f"inside one DC): the datacenters ({', '.join(f'{n}={g}' for n, g in order)}) fit only {fits}; "
        f"{missing_stages} more stage(s) need {missing_stages * per_stage} more GPUs in groups of {per_stage}"
    )


def round_robin(datacenters: Sequence[tuple[str, int]], pp: int, dp: int, tp: int) -> Placement:
    """The naive placement Atlas is compared against: stages dealt in turn over the DCs in the order given.

    Stage k goes to DC ``k mod n`` (n datacenters, in spec order) while each has room for another
    stage of ``dp * tp`` GPUs; a full DC is skipped and the deal goes on with the next that has
    room. A stage's DP group still stays inside one DC, as in `place`, but consecutive stages sit
    in different DCs, so most pipeline hops cross the WAN (with DCs of equal size, every hop does).
    Feasible exactly when `place` is (the DCs hold at least `pp` stages in all); otherwise the
    `PlacementError` names, for each DC the rest of the deal would reach, the GPUs it lacks.
    """
    if pp < 1 or dp < 1 or tp < 1:
        raise PlacementError(f"pp, dp and tp must be at least 1 (got pp={pp}, dp={dp}, tp={tp})")
    if not datacenters:
        raise PlacementError("cannot place pipeline stages: no datacenters")
    per_stage = dp * tp
    names = [name for name, _ in datacenters]
    room = [gpus // per_stage for _, gpus in datacenters]
    stage_dc: list[str] = []
    turn = 0  # index of the DC whose turn it is
    while len(stage_dc) < pp and any(room):
        if room[turn]:
            stage_dc.append(names[turn])
            room[turn] -= 1
        turn = (turn + 1) % len(names)
    if len(stage_dc) == pp:
        return Placement(tuple(stage_dc), dp, tp)
    # Every DC is full: deal the rest on, as if each had room, and count what each one lacks.
    extra = [0] * len(names)
    for k in range(pp - len(stage_dc)):
        extra[(turn + k) % len(names)] += 1
    lacks = [
        f"{e * per_stage - gpus % per_stage} more GPUs in {name} ({e} stage(s))"
        for (name, gpus), e in zip(datacenters, extra, strict=True)
        if e
    ]
    held = ", ".join(f"{name}={gpus} holds {gpus // per_stage}" for name, gpus in datacenters)
    raise PlacementError(
        f"cannot place {pp} pipeline stages round-robin, {per_stage} GPUs each (DP={dp} x TP={tp}, a stage's "
        f"group stays inside one DC): {held}, {len(stage_dc)} in all; the other {pp - len(stage_dc)} "
        f"stage(s), dealt on in turn, need {', '.join(lacks)}"
    )
