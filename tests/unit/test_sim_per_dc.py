"""The simulator with a dispatcher per datacenter (`--dispatch per-dc`, issue 66) on the demo spec."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from bubbletea.cli import main as cli_main
from shared.config.spec import load_spec
from shared.policies.events import EventQueue
from shared.policies.pipeline_run import PipelineRun
from shared.wire.status import FailureReason
from sim.dispatchers import DispatchMode
from sim.output import figures
from sim.run import SimOptions, run_off, simulate
from sim.serving import Serving
from sim.setup import build
from sim.workload import generated

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
ITERATIONS = 6


def test_per_dc_answers_in_both_datacenters_and_leaves_training_as_it_was() -> None:
    one = figures(simulate(load_spec(DEMO), SimOptions(iterations=ITERATIONS)))
    r = simulate(load_spec(DEMO), SimOptions(iterations=ITERATIONS, dispatch=DispatchMode.PER_DC))
    per_dc = figures(r)
    assert per_dc["dispatch"] == "per_dc" and one["dispatch"] == "one"
    served = per_dc["requests_served_by_dc"]
    assert set(served) == {"dc-a", "dc-b"} and min(served.values()) > 100
    assert sum(served.values()) == per_dc["requests_served"]
    assert per_dc["requests_routed"]["soonest"] > 0.5 * per_dc["requests_sent"]
    assert per_dc["requests_expired"] == 0 and per_dc["recomputed_share"] == 0.0  # resumed in its own DC only
    # training is the guest's host: the same tolerance as test_sim's (1%), and the same iteration as one dispatcher's
    assert abs(per_dc["train_slowdown_pct"]) < 1.0
    assert per_dc["iteration_ms"] == pytest.approx(one["iteration_ms"], rel=0.01)
    assert per_dc["fill_ratio"] > 0.8


def test_per_dc_loses_no_request() -> None:
    """Every request sent is answered, refused or failed for a reason: run on past training's end
    (no more bubbles) until every deadline has passed, and none is left with any dispatcher."""
    setup = build(load_spec(DEMO))
    setup = replace(setup, serving=replace(setup.serving, dispatch=DispatchMode.PER_DC, timeout_s=2.0))
    off = run_off(setup, ITERATIONS)
    load = generated(400.0, input_len=96, range_ratio=0.5, max_tokens=setup.max_prompt_tokens, seed=3)
    q = EventQueue()
    serving = Serving(setup.serving, q, itertools.takewhile(lambda a: a[0] < 2.64, load))
    training = PipelineRun(
        setup.pipeline, ITERATIONS, q, guest=serving, priors=off.priors, on_done=lambda now: q.stop(), bus_s=0.0003
    )
    training.start()
    serving.start()
    q.run()
    q.run(until=q.now + 3.0)  # past every deadline: the dispatchers' timers fail what is left
    s = serving.stats
    assert s.sent > 600 and serving.dispatch.known == 0
    assert len(s.ttfts_s) + sum(s.failed.values()) + s.rejected + s.moved == s.sent
    assert set(s.failed) <= {FailureReason.OVERLOADED.value, FailureReason.DEADLINE.value}
    assert set(s.answered_in) == {"dc-a", "dc-b"}


def test_the_command_selects_per_dc_and_says_what_it_routed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--config", str(DEMO), "--no-folder", "--iterations", "3", "--dispatch", "per-dc", "--json"]
    assert cli_main(argv) == 0
    out = capsys.readouterr()
    f = json.loads(out.out)
    assert f["dispatch"] == "per_dc" and f["requests_served_by_dc"]
    assert "a dispatcher per datacenter: requests routed" in out.err


def test_the_snapshots_interval_is_a_knob(capsys: pytest.CaptureFixture[str]) -> None:
    """Published and read every 50 ms (the live dispatcher's tick, the default), the front door has its
    first snapshot sooner than every 250 ms (fewer requests sent blind) and routes on fresher ones; a
    bad interval is one sentence and status 2."""
    base = ["simulate", "--config", str(DEMO), "--no-folder", "--iterations", "3", "--dispatch", "per-dc", "--json"]
    assert cli_main(base) == 0
    live = json.loads(capsys.readouterr().out)["requests_routed"]
    assert cli_main([*base, "--snapshot-every-ms", "250"]) == 0
    slow = json.loads(capsys.readouterr().out)["requests_routed"]
    assert 0 < live["none_fresh"] < slow["none_fresh"]
    assert cli_main([*base, "--snapshot-every-ms", "0"]) == 2
    assert "interval must be > 0" in capsys.readouterr().err
