"""Atlas stage placement: which datacenter runs each pipeline stage.

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
