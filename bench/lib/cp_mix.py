"""The control plane's event mix, taken from the simulator (bench/control_plane.py).

For a job of G GPUs the simulator's own scale case (`bench/sim_scale.py`: 4 datacenters, PP=16,
TP=8, so G/8 workers, ~512-token prompts) is run with BubbleTea on, and what its one dispatcher
takes is counted as `bench/sim_scale.py` counts `dispatcher_inputs_per_s`: requests, a bubble start
and a bubble end per bubble, a report per batch. `Mix` keeps them apart, per simulated second, and
scales them to fewer workers: the same events a worker a second, and requests in proportion.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

#: The simulator's figures of dispatcher inputs a second (docs/simulator.md, 2026-11-28, load 0.5),
#: for comparison with what this run of the simulator counts.
DOCUMENTED_INPUTS_PER_S = {512: 2_229, 2_048: 10_505, 8_192: 39_644}
#: The load (share of what the bubbles could hold) those figures were counted at.
SIM_LOAD = 0.5
SIM_ITERATIONS = 3
#: Workers per pipeline replica in the emulation (the simulator's PP).
PP = 16


@dataclass(frozen=True)
class Mix:
    """Per second of one job: what its dispatcher takes, by kind, and what the workers are."""

    gpus: int
    workers: int  # G/8: one per pipeline slot (TP=8)
    requests_per_s: float
    bubbles_per_s: float  # bubbles begun (each is a start and an end)
    reports_per_s: float  # batches reported
    bubble_fraction: float  # of a worker's time, in bubbles
    source: str

    @property
    def inputs_per_s(self) -> float:
        return self.requests_per_s + 2 * self.bubbles_per_s + self.reports_per_s

    @property
    def bubbles_per_worker_s(self) -> float:
        return self.bubbles_per_s / self.workers

    def scaled(self, workers: int) -> Mix:
        """The same mix on `workers` workers: each as busy with bubbles, requests in proportion."""
        f = workers / self.workers
        return Mix(
            self.gpus,
            workers,
            self.requests_per_s * f,
            self.bubbles_per_s * f,
            self.reports_per_s * f,
            self.bubble_fraction,
            self.source,
        )

    def figures(self) -> dict[str, Any]:
        return asdict(self) | {"inputs_per_s": round(self.inputs_per_s, 1)}


def workers_for(mix: Mix, share: float) -> int:
    """Workers for `share` of the job, whole pipeline replicas (PP each), at least one."""
    return PP * max(1, round(mix.workers * share / PP))


def from_simulator(gpus: int, load: float = SIM_LOAD, seed: int = 0) -> Mix:
    """Run the simulator's scale case for `gpus` (a few seconds at 8,192) and count its mix."""
    from bench.sim_scale import INPUT_LEN, scale_spec
    from sim.run import SimOptions, run_off, simulate_on
    from sim.setup import build

    t0 = time.perf_counter()
    setup = build(scale_spec(gpus))
    off = run_off(setup, SIM_ITERATIONS)
    on = simulate_on(setup, off, SimOptions(iterations=SIM_ITERATIONS, input_len=INPUT_LEN, load=load, seed=seed)).on
    assert on is not None and on.serving is not None, "a run with BubbleTea on"
    s, span = on.serving, on.makespan
    waits = [sp for sp in on.spans if sp.kind == "wait"]
    workers = len({(sp.replica, sp.stage) for sp in on.spans})
    idle = sum(sp.end - sp.start for sp in waits) / (workers * span)
    return Mix(
        gpus=gpus,
        workers=workers,
        requests_per_s=s.sent / span,
        bubbles_per_s=len(waits) / span,
        reports_per_s=s.batches / span,
        bubble_fraction=round(min(0.9, max(0.05, idle)), 3),
        source=f"sim (bench/sim_scale.py's case, load {load}, seed {seed}, {SIM_ITERATIONS} iterations; "
        f"{time.perf_counter() - t0:.1f} s to simulate)",
    )
