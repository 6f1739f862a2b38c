"""One simulation of a spec: training with BubbleTea off, then on under a load, and the figures.

1. **off**: the pipeline alone (`shared.policies.pipeline_run.PipelineRun` with no guest). Its iteration-1 bubbles
   are every worker's prior bubble lengths, as a live worker takes them from the analytic model
   (which this run reproduces exactly).
2. **on**: the same pipeline with `sim.serving.Serving` as its guest, requests arriving from the
   load generator's processes or a trace, until the last iteration ends.

Every figure comes from `shared.figures` (the one definition the live report uses): utilization,
bubble fraction and fill ratio from the runs' spans (`runstats`), the steady iteration time (the
median of the iterations after the first, as `bubbletea train` reports it: `training`), and the
default load's rate from the bubbles' capacity (`bubblestats`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from shared.config.spec import ClusterSpec
from shared.figures.bubblestats import capacity_requests_per_s
from shared.figures.training import steady_iteration_s
from shared.policies.events import EventQueue
from shared.policies.pipeline_run import PipelineRun, priors
from shared.policies.spans import Span
from sim.dispatchers import DispatchMode
from sim.serving import Serving, ServingStats
from sim.setup import BUS_S, DEFAULT_FWD_MS, SimError, SimSetup, build
from sim.workload import Arrivals, generated, replayed

#: The load's prompts when no trace is given: 48-144 tokens, as the demo's load generator sends.
INPUT_LEN = 96
RANGE_RATIO = 0.5

Progress = Callable[[int, float], None]  # (iteration, virtual time) at each iteration's end


@dataclass(frozen=True)
class SimOptions:
    iterations: int = 10
    request_rate: float | None = None  # None: `load` x the bubbles' estimated capacity (`capacity_rate`)
    load: float = 1.0
    max_rate: float = math.inf  # the default rate is at most this
    trace: Path | None = None
    time_scale: float = 1.0
    input_len: int = INPUT_LEN
    range_ratio: float = RANGE_RATIO
    burstiness: float = 1.0
    seed: int = 0
    fwd_ms: float = DEFAULT_FWD_MS
    bus_s: float = BUS_S
    bubbletea: bool = True  # run the second, BubbleTea-on simulation
    dispatch: DispatchMode = DispatchMode.ONE  # one dispatcher, or one per datacenter (`sim.dispatchers`)
    snapshot_every_s: float | None = None  # per DC: how often snapshots are published and read (None: live's)


@dataclass
class RunResult:
    """One simulated training run."""

    spans: list[Span]
    iteration_times: list[float]
    events: int
    wall_s: float
    serving: ServingStats | None = None
    priors: list[dict[int, float]] = field(default_factory=list)
    cpu_s: float = 0.0  # this process's CPU seconds for it (beside wall_s on a shared machine)

    @property
    def iteration_s(self) -> float:
        """Median iteration time after the warm-up iteration (as `bubbletea train` reports it)."""
        return steady_iteration_s(self.iteration_times)

    @property
    def makespan(self) -> float:
        return sum(self.iteration_times)


@dataclass
class SimResult:
    setup: SimSetup
    options: SimOptions
    off: RunResult
    on: RunResult | None
    request_rate: float | None  # requests/s offered (None: a trace)


def simulate(spec: ClusterSpec, options: SimOptions, progress: Progress | None = None) -> SimResult:
    if options.iterations < 2:
        raise SimError(f"--iterations must be at least 2 (iteration 0 is the warm-up), got {options.iterations}")
    setup = build(spec, fwd_ms=options.fwd_ms, bus_s=options.bus_s)
    off = run_off(setup, options.iterations, progress)
    if not options.bubbletea:
        return SimResult(setup, options, off, None, None)
    return simulate_on(setup, off, options, progress)


def simulate_on(setup: SimSetup, off: RunResult, options: SimOptions, progress: Progress | None = None) -> SimResult:
    """The BubbleTea-on run of `simulate`, beside an `off` run of the same setup (a load sweep
    simulates the off run once)."""
    rate = None
    if options.trace is not None:
        arrivals = replayed(options.trace, max_tokens=setup.max_prompt_tokens, time_scale=options.time_scale)
    else:
        rate = options.request_rate
        if rate is None:
            if not options.load > 0:
                raise SimError(f"the load must be a share > 0 of the bubbles' capacity, got {options.load}")
            rate = min(options.load * capacity_rate(setup, off, options), options.max_rate)
        arrivals = generated(
            rate,
            input_len=options.input_len,
            range_ratio=options.range_ratio,
            max_tokens=setup.max_prompt_tokens,
            burstiness=options.burstiness,
            seed=options.seed,
        )
    serving = replace(setup.serving, dispatch=options.dispatch)
    if options.snapshot_every_s is not None:
        if not options.snapshot_every_s > 0:
            raise SimError(f"the snapshots' interval must be > 0 s, got {options.snapshot_every_s}")
        serving = replace(serving, snapshot_every_s=options.snapshot_every_s)
    if serving != setup.serving:
        setup = replace(setup, serving=serving)
    on = run_on(setup, options.iterations, off.priors, arrivals, progress)
    return SimResult(setup, options, off, on, rate)


def run_off(setup: SimSetup, iterations: int, progress: Progress | None = None) -> RunResult:
    q = EventQueue()
    training = PipelineRun(setup.pipeline, iterations, q, on_iteration=progress, bus_s=setup.serving.bus_s)
    wall, cpu = time.perf_counter(), time.process_time()
    with collector_paused():
        training.start()
        q.run()
        result = training.result()
        wall = time.perf_counter() - wall
        # the analytic model's, not this run's: the bus hops make this run's bubbles a little
        # longer than the prior a live worker starts from
        prior = priors(setup.pipeline, iteration=1)
        cpu = time.process_time() - cpu
    return RunResult(result.spans, result.iteration_times, q.events, wall, priors=prior, cpu_s=cpu)


def run_on(
    setup: SimSetup,
    iterations: int,
    priors: list[dict[int, float]],
    arrivals: Arrivals,
    progress: Progress | None = None,
) -> RunResult:
    q = EventQueue()
    serving = Serving(setup.serving, q, arrivals)
    training = PipelineRun(
        setup.pipeline,
        iterations,
        q,
        guest=serving,
        priors=priors,
        on_iteration=progress,
        on_done=lambda now: q.stop(),
        bus_s=setup.serving.bus_s,  # --bus-ms reaches training's tensors too
    )
    slots = training.slots
    serving.iteration_of = lambda w: slots[w].walk.iteration
    wall, cpu = time.perf_counter(), time.process_time()
    with collector_paused():
        training.start()
        serving.start()
        q.run()
        result = training.result()
        spans = result.spans + [
            Span(slots[w].walk.replica, slots[w].walk.stage, it, "prefill", start, end)
            for w, it, start, end in serving.spans
        ]
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return RunResult(spans, result.iteration_times, q.events, wall, serving.stats, cpu_s=cpu)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a run. A run keeps what it makes (spans,
    bubbles, requests: millions of objects at 8,192 GPUs) and each full collection walked all of
    them again: 2.0 of the 16.2 s of a 3-iteration 8,192-GPU BubbleTea-on run. The run leaves
    little cyclic garbage (~110,000 objects there: one collection, 0.4 s, whenever the next comes
    after the run)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def capacity_rate(setup: SimSetup, off: RunResult, options: SimOptions) -> float:
    """Requests/s the bubbles could hold: the bubble seconds per second over all workers that the fit
    rule can fill with a mean prompt's blocks (`fill.usable_s`), divided by one mean prompt's whole
    prefill time. The default load, so the bubbles have work to fill."""
    profile, layers = setup.serving.profile, setup.model.layers

    def per_layer_s(tokens: int) -> float:  # a whole prompt's time (pieces, launches, its read) a layer
        return profile.request_s(tokens, layers) / layers

    block = profile.block_s(profile.pieces(options.input_len)[0])  # what the fit rule weighs: a layer or a piece
    rate = capacity_requests_per_s(off.spans, per_layer_s, layers, options.input_len, fit_block_s=block)
    if rate <= 0:
        raise SimError("the pipeline has no bubbles to fill: give --request-rate to simulate a load anyway")
    return rate
