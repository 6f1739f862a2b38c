"""The analytic pipeline model against hand-computed timelines and the textbook bubble formula."""

from pathlib import Path

import msgspec
import pytest

from shared.config.spec import load_spec
from shared.policies.pipeline_model import PipelineInputs
from shared.policies.pipeline_plan import model_inputs, predict
from shared.policies.pipeline_run import simulate
from shared.policies.schedules import SCHEDULES, compute_bubble_fraction
from shared.policies.wan import LinkModel, SlotControl


def local(p: int, dp: int, m: int, sched: str, fwd: float = 1.0, bwd: float = 1.0) -> PipelineInputs:
    return PipelineInputs(
        stages=p,
        dp=dp,
        microbatches=m,
        schedule=sched,
        stage_dc=("a",) * p,
        fwd_s=(fwd,) * p,
        bwd_s=(bwd,) * p,
        act_bytes=100,
        links={},
    )


@pytest.mark.parametrize("sched", SCHEDULES)
def test_compute_only_bubble_matches_the_formula(sched: str) -> None:
    for p in range(1, 7):
        for m in range(1, 9):
            r = simulate(local(p, 1, m, sched))
            assert r.makespan == pytest.approx(2 * (m + p - 1))
            assert r.bubble_fraction() == pytest.approx(compute_bubble_fraction(p, m))


def test_cross_dc_timeline_by_hand() -> None:
    # stage 0 in dc a, stage 1 in dc b; 100 B over a 100 B/s link with 1 s latency: 1 s + 1 s
    link = LinkModel(bandwidth=100.0, latency=1.0, flow_cap=100.0)
    inp = PipelineInputs(
        stages=2,
        dp=1,
        microbatches=1,
        schedule="1f1b",
        stage_dc=("a", "b"),
        fwd_s=(1.0, 1.0),
        bwd_s=(1.0, 1.0),
        act_bytes=100,
        links={("a", "b"): link, ("b", "a"): link},
    )
    r = simulate(inp)
    compute = sorted((s.stage, s.kind, s.start, s.end) for s in r.spans if s.kind != "wait")
    assert compute == [(0, "bwd", 7.0, 8.0), (0, "fwd", 0.0, 1.0), (1, "bwd", 4.0, 5.0), (1, "fwd", 3.0, 4.0)]
    assert r.makespan == 8.0
    assert sorted((b.stage, b.position, b.start, b.length) for b in r.bubbles) == [(0, 2, 1.0, 6.0), (1, 0, 0.0, 3.0)]
    assert r.predicted_bubble(0, 1, 0) == 3.0 and r.predicted_bubble(0, 1, 5) == 0.0


def test_cross_dc_timeline_over_sockets_by_hand() -> None:
    # the same pipeline on a link the broker grants (WAN modes kernel / none): no latency (as in
    # kernel mode), headers 1.25 wire bytes per payload byte, the slot protocol's hops 0.1 s to
    # request, 0.2 s to start. Activation: sent at 1, requested 1.1, bytes 1.3-2.55; stage 1
    # computes 2.55-4.55; the gradient: sent 4.55, bytes 4.85-6.1; stage 0's backward 6.1-7.1
    control = SlotControl(request_s=0.1, start_s=0.2, report_s=0.05)
    link = LinkModel(bandwidth=100.0, latency=0.0, flow_cap=100.0, overhead=1.25, control=control)
    inp = PipelineInputs(
        stages=2,
        dp=1,
        microbatches=1,
        schedule="1f1b",
        stage_dc=("a", "b"),
        fwd_s=(1.0, 1.0),
        bwd_s=(1.0, 1.0),
        act_bytes=100,
        links={("a", "b"): link, ("b", "a"): link},
    )
    r = simulate(inp)
    compute = sorted((s.stage, s.kind, round(s.start, 9), round(s.end, 9)) for s in r.spans if s.kind != "wait")
    assert compute == [(0, "bwd", 6.1, 7.1), (0, "fwd", 0.0, 1.0), (1, "bwd", 3.55, 4.55), (1, "fwd", 2.55, 3.55)]
    assert r.makespan == pytest.approx(7.1)


def test_granted_links_with_free_control_and_no_headers_match_the_emulated_ones() -> None:
    """The slot protocol at zero cost, no latency for the ready notice to cross, one transfer per
    pair at a time: the same timeline as LinkSharing's."""
    free = SlotControl(0.0, 0.0, 0.0)
    for sharing in ("fair", "temporal"):
        one = PipelineInputs(**{**wan_bound(sharing, dp=2).__dict__, "microbatches": 1})
        bare = {k: LinkModel(m.bandwidth, 0.0, m.flow_cap) for k, m in one.links.items()}
        granted = {k: LinkModel(m.bandwidth, 0.0, m.flow_cap, control=free) for k, m in one.links.items()}
        base = simulate(PipelineInputs(**{**one.__dict__, "links": bare}), 2)
        assert simulate(PipelineInputs(**{**one.__dict__, "links": granted}), 2).iteration_times == pytest.approx(
            base.iteration_times
        )


def wan_bound(sharing: str, dp: int = 2, flow_cap: float = 100.0) -> PipelineInputs:
    link = LinkModel(bandwidth=100.0, latency=0.1, flow_cap=flow_cap)
    return PipelineInputs(
        stages=2,
        dp=dp,
        microbatches=4,
        schedule="1f1b",
        stage_dc=("a", "b"),
        fwd_s=(0.5, 0.5),
        bwd_s=(1.0, 1.0),
        act_bytes=100,
        links={("a", "b"): link, ("b", "a"): link},
        sharing=sharing,
    )


def test_temporal_beats_fair_when_replicas_share_the_link() -> None:
    fair, temporal = simulate(wan_bound("fair"), 3), simulate(wan_bound("temporal"), 3)
    assert temporal.iteration_times[-1] < fair.iteration_times[-1]
    assert temporal.bubble_fraction() < fair.bubble_fraction()
    # one replica: its consecutive microbatches still overlap on the link; temporal sends the
    # earlier (critical) one first
    assert simulate(wan_bound("temporal", dp=1), 2).makespan < simulate(wan_bound("fair", dp=1), 2).makespan


def test_policies_coincide_when_transfers_never_overlap() -> None:
    def one(sharing: str) -> float:
        inp = wan_bound(sharing, dp=1)
        return simulate(PipelineInputs(**{**inp.__dict__, "microbatches": 1}), 2).makespan

    assert one("fair") == pytest.approx(one("temporal")) == pytest.approx(one("fifo"))


def test_more_connections_help_a_window_capped_link() -> None:
    one = simulate(wan_bound("temporal", flow_cap=25.0), 2)
    many = simulate(wan_bound("temporal", flow_cap=100.0), 2)
    assert many.makespan < one.makespan


def test_multi_iteration_and_data_parallel_barrier() -> None:
    r = simulate(local(2, 2, 2, "gpipe"), iterations=3)
    assert len(r.iteration_times) == 3
    assert r.iteration_times == pytest.approx([6.0, 6.0, 6.0])
    assert {s.iteration for s in r.spans} == {0, 1, 2}
    assert len({(s.replica, s.stage) for s in r.spans}) == 4


def test_the_prediction_takes_the_links_of_the_specs_wan_mode() -> None:
    """`predict` models the link the spec's WAN mode builds: model mode the broker's emulation
    (what its LinkDriver runs, the same LinkModel), kernel mode headers, no delay and the slot
    protocol."""
    spec = load_spec(Path(__file__).parents[2] / "configs" / "wan-bound.yaml")
    for mode in ("model", "kernel"):
        moded = msgspec.structs.replace(spec, wan=msgspec.structs.replace(spec.wan, mode=mode))
        links = model_inputs(moded, 10.0, 20.0).links
        assert links[("dc-a", "dc-b")] == LinkModel.from_params(spec.link("dc-a", "dc-b"), mode)
    assert predict(spec, 10.0, 20.0).iteration_times[-1] == pytest.approx(0.44)  # `bubbletea plan`'s temporal row


def test_the_step_waits_for_every_stage_of_its_replica_a_bubble_at_the_steps_position() -> None:
    """As a live step sums the global norm across stages first: with 1F1B on 2 stages of 1 s
    forwards and backwards and 2 microbatches, stage 1 ends its last backward at 5 s and stage 0 at
    6 s, so stage 1 waits 1 s at its step (a bubble the workers' priors then predict); without the
    barrier it steps at once."""
    from dataclasses import replace

    from shared.policies.schedules import Op, schedule

    base = local(2, 1, 2, "1f1b")
    step_pos = [a.op for a in schedule("1f1b", 1, 2, 2)].index(Op.STEP)
    free = simulate(base)
    assert not [b for b in free.bubbles if b.position == step_pos and b.stage == 1]
    held = simulate(replace(base, step_collectives=True), iterations=2)
    (b,) = [b for b in held.bubbles if (b.stage, b.position, b.iteration) == (1, step_pos, 0)]
    assert (b.start, b.length) == (5.0, 1.0)
    assert held.iteration_times[0] == free.iteration_times[0]  # the last stage to finish steps as before
    assert held.predicted_bubble(0, 1, step_pos) == 1.0
    spec = load_spec(Path(__file__).parents[2] / "configs" / "wan-bound.yaml")
    assert model_inputs(spec, 10.0, 20.0).step_collectives  # pp > 1 with clipping: the live step's collectives
