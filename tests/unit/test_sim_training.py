"""The simulator's clock and training side: events in time order, the analytic model's timeline exactly."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shared.config import ClusterSpec, load_spec
from shared.plan import model_inputs
from shared.policies.pipeline_model import PipelineInputs, simulate
from sim.events import EventQueue
from sim.run import run_off
from sim.setup import build
from sim.training import Training

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_events_run_in_time_order_ties_in_scheduling_order() -> None:
    q = EventQueue()
    seen: list[tuple[float, str]] = []

    def note(t: float, what: str) -> None:
        seen.append((t, what))
        if what == "a":
            q.at(t, note, "a-now")  # scheduled at the present: runs after what is already due then
            q.at(t + 0.5, note, "a-later")

    for t, what in ((2.0, "c"), (1.0, "a"), (1.0, "b"), (3.0, "d")):
        q.at(t, note, what)
    q.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (1.0, "a-now"), (1.5, "a-later"), (2.0, "c"), (3.0, "d")]
    assert q.events == 6 and q.now == 3.0
    with pytest.raises(ValueError, match="in the past"):
        q.at(2.0, note, "late")


def test_stop_ends_the_run_after_the_current_event() -> None:
    q = EventQueue()
    seen: list[str] = []
    q.at(1.0, lambda t, w: (seen.append(w), q.stop()), "first")
    q.at(2.0, lambda t, w: seen.append(w), "never")
    q.run()
    assert seen == ["first"]


def _model_spans(inp: PipelineInputs, iterations: int) -> tuple[list[tuple[object, ...]], list[float], float]:
    r = simulate(inp, iterations)
    spans = sorted((s.replica, s.stage, s.iteration, s.kind, s.start, s.end, s.mb) for s in r.spans)
    return spans, r.iteration_ends, r.bubble_fraction()


def _sim_spans(inp: PipelineInputs, iterations: int) -> tuple[list[tuple[object, ...]], list[float], float]:
    q = EventQueue()
    t = Training(inp, iterations, q)
    t.start()
    q.run()
    r = t.result()
    spans = sorted(
        (s.replica, s.stage, s.iteration, s.kind, s.start, s.end, -1 if s.microbatch is None else s.microbatch)
        for s in r.spans
    )
    busy = sum(s.end - s.start for s in r.spans if s.kind != "wait")
    slots = inp.stages * inp.dp
    return spans, r.iteration_ends, 1 - busy / (slots * r.iteration_ends[-1])


def _variant(spec: ClusterSpec, **training: object) -> ClusterSpec:
    return msgspec.structs.replace(spec, training=msgspec.structs.replace(spec.training, **training))


@pytest.mark.parametrize("config", ["demo.yaml", "wan-bound.yaml"])
@pytest.mark.parametrize("sharing", ["temporal", "fair", "fifo"])
@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
def test_bubbletea_off_reproduces_the_analytic_model(config: str, sharing: str, sched: str) -> None:
    """Same spans (every fwd, bwd, wait, all-reduce, step), same iteration ends, same bubble
    fraction: the simulator's training is the analytic model's, on the shipped specs."""
    spec = _variant(load_spec(CONFIGS / config), schedule=sched)
    inp = model_inputs(spec, 10.0, 20.0, sharing)
    assert _sim_spans(inp, 4) == _model_spans(inp, 4)


def test_three_datacenters_deep_pipeline_matches_too() -> None:
    spec = load_spec(CONFIGS / "paper-scale.yaml")
    spec = _variant(spec, microbatches=4)
    inp = model_inputs(spec, 4.0, 8.0)
    assert len(set(inp.stage_dc)) == 3
    assert _sim_spans(inp, 2) == _model_spans(inp, 2)


def test_the_off_run_gives_every_worker_the_models_prior() -> None:
    """A live worker's prior is the analytic model's iteration-1 bubble per schedule position."""
    spec = load_spec(CONFIGS / "demo.yaml")
    setup = build(spec)
    off = run_off(setup, 3)
    model = simulate(setup.pipeline, 2)
    for w, prior in enumerate(off.priors):
        d, k = divmod(w, spec.parallelism.pp)
        expected = {b.position: b.length for b in model.bubbles if (b.replica, b.stage, b.iteration) == (d, k, 1)}
        assert prior == pytest.approx(expected)
    assert any(off.priors)
