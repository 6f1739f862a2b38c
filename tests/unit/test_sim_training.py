"""The simulator's clock and training side: events in time order, the analytic model's timeline exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from shared.config import ClusterSpec, load_spec
from shared.figures.runstats import Span
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
    """The analytic model's timeline, its all-reduce as a live worker records it: the wait at the
    barrier (a mb-less wait ending where the slot's all-reduce starts) and the cost in one span."""
    r = simulate(inp, iterations)
    reduce_end = {(s.replica, s.stage, s.iteration): (s.start, s.end) for s in r.spans if s.kind == "allreduce"}
    barrier_waits = {
        (s.replica, s.stage, s.iteration): s.start
        for s in r.spans
        if s.kind == "wait"
        and (s.mb is None or s.mb < 0)
        and reduce_end.get((s.replica, s.stage, s.iteration), (None,))[0] == s.end
    }
    spans: list[tuple[object, ...]] = []
    for s in r.spans:
        slot = (s.replica, s.stage, s.iteration)
        if s.kind == "wait" and (s.mb is None or s.mb < 0) and barrier_waits.get(slot) == s.start:
            continue  # the all-reduce's barrier (the step's barrier, a wait too, stays one)
        start = barrier_waits.get(slot, s.start) if s.kind == "allreduce" else s.start
        spans.append((*slot, s.kind, start, s.end, -1 if s.mb is None else s.mb))
    return sorted(spans), r.iteration_ends, _bubble(spans, inp, r.iteration_ends[-1])


def _same(sim: tuple[list[tuple[object, ...]], list[float], float], model: tuple[object, ...]) -> None:
    assert sim[:2] == model[:2]
    assert sim[2] == pytest.approx(model[2])


def _bubble(spans: list[tuple[object, ...]], inp: PipelineInputs, end: float) -> float:
    busy = sum(float(s[5]) - float(s[4]) for s in spans if s[3] != "wait")  # type: ignore[arg-type]
    return 1 - busy / (inp.stages * inp.dp * end)


def _sim_spans(inp: PipelineInputs, iterations: int) -> tuple[list[tuple[object, ...]], list[float], float]:
    q = EventQueue()
    t = Training(inp, iterations, q, bus_s=0.0)
    t.start()
    q.run()
    r = t.result()
    spans: list[tuple[object, ...]] = sorted(
        (s.replica, s.stage, s.iteration, s.kind, s.start, s.end, -1 if s.microbatch is None else s.microbatch)
        for s in r.spans
    )
    return spans, r.iteration_ends, _bubble(spans, inp, r.iteration_ends[-1])


def _variant(spec: ClusterSpec, **training: object) -> ClusterSpec:
    return msgspec.structs.replace(spec, training=msgspec.structs.replace(spec.training, **training))


@pytest.mark.parametrize("config", ["demo.yaml", "wan-bound.yaml"])
@pytest.mark.parametrize("sharing", ["temporal", "fair", "fifo"])
@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
@pytest.mark.parametrize("mode", ["model", "kernel"])
def test_bubbletea_off_reproduces_the_analytic_model(config: str, sharing: str, sched: str, mode: str) -> None:
    """With no bus latency: same spans (every fwd, bwd, wait, all-reduce, step; the wait at the
    all-reduce inside its span, as a live worker records it), same iteration ends, same bubble
    fraction: the simulator's training is the analytic model's, on the shipped specs, with the
    links of WAN mode model (LinkSharing) and of kernel (the slot protocol over sockets)."""
    spec = _variant(load_spec(CONFIGS / config), schedule=sched)
    spec = msgspec.structs.replace(spec, wan=msgspec.structs.replace(spec.wan, mode=mode))
    inp = model_inputs(spec, 10.0, 20.0, sharing)
    _same(_sim_spans(inp, 4), _model_spans(inp, 4))


def test_three_datacenters_deep_pipeline_matches_too() -> None:
    spec = load_spec(CONFIGS / "paper-scale.yaml")
    spec = _variant(spec, microbatches=4)
    inp = model_inputs(spec, 4.0, 8.0)
    assert len(set(inp.stage_dc)) == 3
    _same(_sim_spans(inp, 2), _model_spans(inp, 2))


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


def _run(inp: PipelineInputs, iterations: int, bus_s: float) -> list[Span]:
    q = EventQueue()
    t = Training(inp, iterations, q, bus_s=bus_s)
    t.start()
    q.run()
    return t.result().spans


def test_waiting_at_the_all_reduce_is_inside_its_span_as_on_a_live_worker() -> None:
    """services/stage_worker/runner.py: one `allreduce` span from the slot's arrival to the end,
    the same instant for every DP peer; no `wait` (no bubble) at the barrier."""
    inp = model_inputs(load_spec(CONFIGS / "demo.yaml"), 10.0, 20.0)
    spans = _run(dataclasses.replace(inp, fwd_s=(0.01, 0.013)), 2, 0.0)
    assert not [s for s in spans if s.kind == "wait" and s.microbatch is None]
    ends: dict[tuple[int, int], set[float]] = {}
    for s in spans:
        if s.kind == "allreduce":
            ends.setdefault((s.stage, s.iteration), set()).add(s.end)
    assert ends and all(len(e) == 1 for e in ends.values())


def test_every_tensor_crosses_the_bus_once() -> None:
    """A same-DC activation reaches the next stage one bus hop after it was sent; a cross-DC one
    one hop after the WAN delivered it; the last peer's gradients one hop before the all-reduce ends."""
    hop = 0.002
    inp = model_inputs(load_spec(CONFIGS / "demo.yaml"), 10.0, 20.0)
    local = dataclasses.replace(inp, stage_dc=("dc-a", "dc-a"), allreduce_s=(0.0, 0.0))
    first_wait = {bus: next(s for s in _run(local, 1, bus) if s.stage == 1 and s.kind == "wait") for bus in (0, hop)}
    assert first_wait[hop].end - first_wait[0].end == pytest.approx(hop)
    reduce = [s for s in _run(local, 1, hop) if s.kind == "allreduce"]
    assert reduce and all(s.end - s.start >= hop - 1e-12 for s in reduce)
    wan = {bus: next(s for s in _run(inp, 1, bus) if s.stage == 1 and s.kind == "wait") for bus in (0, hop)}
    assert wan[hop].end - wan[0].end == pytest.approx(hop)
