"""The virtual clock and the one pipeline engine (the analytic model's and the simulator's): events in
time order, whole schedules walked, bus hops, the all-reduce as a live worker records it."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import msgspec
import pytest

from shared.config.spec import ClusterSpec, load_spec, parse_spec
from shared.figures.training import steady_iteration_s
from shared.policies.events import EventQueue
from shared.policies.pipeline_model import PipelineInputs
from shared.policies.pipeline_plan import model_inputs
from shared.policies.pipeline_run import PipelineRun, simulate
from shared.policies.schedules import Op, schedule
from shared.policies.spans import Span
from sim.run import run_off
from sim.setup import build

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


@pytest.mark.parametrize("config", ["demo.yaml", "wan-bound.yaml"])
@pytest.mark.parametrize("sharing", ["temporal", "fair", "fifo"])
@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
@pytest.mark.parametrize("mode", ["model", "kernel"])
def test_every_slot_walks_its_whole_schedule_in_order(config: str, sharing: str, sched: str, mode: str) -> None:
    """On the shipped specs, with the links of WAN mode model (LinkSharing) and of kernel (the slot
    protocol over sockets): each slot computes every forward and backward of its schedule, in the
    schedule's order, each iteration; its spans never overlap; every slot ends each iteration
    with one step; bubbles are exactly the `wait` spans."""
    spec = _variant(load_spec(CONFIGS / config), schedule=sched)
    spec = msgspec.structs.replace(spec, wan=msgspec.structs.replace(spec.wan, mode=mode))
    inp = model_inputs(spec, 10.0, 20.0, sharing)
    r = PipelineRun(inp, 3, EventQueue(), bus_s=0.0005).run()
    for d in range(inp.dp):
        for k in range(inp.stages):
            mine = sorted((s for s in r.spans if (s.replica, s.stage) == (d, k)), key=lambda s: (s.start, s.end))
            for a, b in itertools.pairwise(mine):
                assert a.end <= b.start + 1e-12, (a, b)
            computed = [(s.kind, s.microbatch) for s in mine if s.kind in ("fwd", "bwd")]
            expected = [
                (a.op.value, a.mb) for a in schedule(sched, k, inp.stages, inp.microbatches) if a.op in (Op.FWD, Op.BWD)
            ]
            assert computed == expected * 3
            assert [s.iteration for s in mine if s.kind == "step"] == [0, 1, 2]
    waits = sorted((s.replica, s.stage, s.iteration, s.start) for s in r.spans if s.kind == "wait")
    assert waits == sorted((b.replica, b.stage, b.iteration, b.start) for b in r.bubbles)


def test_three_datacenters_deep_pipeline_ends_every_iteration() -> None:
    spec = load_spec(CONFIGS / "paper-scale.yaml")
    spec = _variant(spec, microbatches=4)
    inp = model_inputs(spec, 4.0, 8.0)
    assert len(set(inp.stage_dc)) == 3
    r = simulate(inp, 2)
    assert len(r.iteration_ends) == 2 and r.iteration_ends[0] < r.iteration_ends[1]
    assert 0 < r.bubble_fraction() < 1


def _variant(spec: ClusterSpec, **training: object) -> ClusterSpec:
    return msgspec.structs.replace(spec, training=msgspec.structs.replace(spec.training, **training))


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
    return PipelineRun(inp, iterations, EventQueue(), bus_s=bus_s).run().spans


def test_waiting_at_the_all_reduce_is_inside_its_span_as_on_a_live_worker() -> None:
    """services/stage_worker/train/runner.py: one `allreduce` span from the slot's arrival to the end,
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


def test_the_simulator_and_the_analytic_model_agree_on_specs_nobody_tuned_them_for() -> None:
    """Drawn specs (bench/_gen_specs.py: 3-4 datacenters, uneven and asymmetric links, both
    schedules, the step's collectives on or off): the simulator's steady iteration, with its bus
    hops, within 5% of the analytic model's. `bench/sim_vs_live.py --generated N` adds live runs."""
    from bench._gen_specs import generated

    seen = set()
    for raw in generated(12, seed=0):
        spec = parse_spec(raw, source=raw["name"])
        assert len(spec.datacenters) >= 3
        seen.add(spec.training.schedule)
        setup = build(spec)
        sim = run_off(setup, 6).iteration_s
        model = steady_iteration_s(simulate(setup.pipeline, 6).iteration_times)
        assert abs(sim - model) / model < 0.05, raw["name"]
    assert seen == {"gpipe", "1f1b"}
