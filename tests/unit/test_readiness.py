"""The serving readiness gate on a fake clock: every verdict, its reason, and when queued work goes."""

from __future__ import annotations

import pytest

from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import Request
from shared.policies.readiness import BUBBLE_RECHECK_S, ServingGate, SlotView
from shared.wire.status import FailureReason, LeaseState, ServingState

HELD = [SlotView("r0s0", True), SlotView("r0s1", True)]


def gate(**kw: object) -> ServingGate:
    args: dict[str, object] = {"run": "r1", "enabled": True, "unready_after_s": 10.0, **kw}
    return ServingGate(**args)  # type: ignore[arg-type]


def test_starting_until_every_slot_is_held_then_serving_before_the_first_bubble() -> None:
    g = gate()
    v = g.assess([SlotView("r0s0", True), SlotView("r0s1", False)], now=0.0)
    assert v.state is ServingState.STARTING and not v.ready and not v.fail_queued
    assert "1 of 2 slots held" in v.reason and v.retry_after_s == 2
    # every slot held: serving at once (the first iteration's bubbles come within it)
    assert g.assess(HELD, now=1.0).ready


def test_stalled_when_no_bubble_for_the_configured_time_and_serving_again_on_the_next() -> None:
    g = gate(unready_after_s=5.0)
    g.assess(HELD, now=0.0)
    g.saw_bubble(3.0)
    assert g.assess(HELD, now=8.0).ready  # 5 s after the last bubble: still within
    v = g.assess(HELD, now=8.5)
    assert v.state is ServingState.STALLED and v.fail_queued
    assert "no pipeline bubble announced for 5.5s" in v.reason
    g.saw_bubble(9.0)
    assert g.assess(HELD, now=9.1).ready


def test_no_first_bubble_within_the_time_is_a_stall_too() -> None:
    g = gate(unready_after_s=5.0)
    g.assess(HELD, now=0.0)
    assert g.assess(HELD, now=6.0).state is ServingState.STALLED


def test_finished_stopped_and_lost_runs_say_why() -> None:
    done = [SlotView("r0s0", False, LeaseState.DONE), SlotView("r0s1", False, LeaseState.DONE)]
    g = gate()
    g.assess(HELD, now=0.0)
    v = g.assess(done, now=1.0)
    assert v.state is ServingState.FINISHED and "trained all its iterations" in v.reason and v.fail_queued
    # the last slots still finishing while the first ones are done: still serving
    assert g.assess([SlotView("r0s0", False, LeaseState.DONE), SlotView("r0s1", True)], now=1.0).ready

    stopped = [SlotView("r0s0", False, LeaseState.STOPPED, "slot r0s0 was stopped at iteration 7"), HELD[1]]
    v = g.assess(stopped, now=2.0)
    assert v.state is ServingState.STOPPED and "stopped at iteration 7" in v.reason

    aborted = [SlotView("r0s0", False, LeaseState.ABORTED, "slot r0s1 lost its worker"), SlotView("r0s1", False)]
    v = g.assess(aborted, now=3.0)
    assert v.state is ServingState.LOST and "slot r0s1 lost its worker" in v.reason and v.retry_after_s == 30

    v = g.assess([HELD[0], SlotView("r0s1", False)], now=4.0)  # a lease expired without a word
    assert v.state is ServingState.LOST and "slot r0s1 lost its worker (its lease expired)" in v.reason


def test_a_lost_worker_in_a_run_that_checkpoints_is_recovering_until_the_timeout() -> None:
    g = gate(recovery_s=30.0)
    g.assess(HELD, now=0.0)
    lost = [HELD[0], SlotView("r0s1", False)]
    v = g.assess(lost, now=5.0)
    assert v.state is ServingState.RECOVERING and not v.ready and not v.fail_queued  # queued wait, new ones refused
    assert v.retry_after_s == 5
    assert "slot r0s1 lost its worker" in v.reason and "resumes from its last checkpoint" in v.reason
    assert g.assess(lost, now=35.0).state is ServingState.RECOVERING  # 30 s after the loss was first seen
    # a replacement took the slot: serving, and the quiet time of the pause is not a stall
    g2 = gate(recovery_s=30.0, unready_after_s=5.0)
    g2.assess(HELD, now=0.0)
    g2.assess(lost, now=1.0)
    assert g2.assess(HELD, now=20.0).state is ServingState.SERVING
    # nobody came in time: lost, and queued work goes
    v = g.assess(lost, now=35.5)
    assert v.state is ServingState.LOST and v.fail_queued and "lost its worker" in v.reason
    # a new loss later starts a new window
    g.assess(HELD, now=40.0)
    assert g.assess(lost, now=41.0).state is ServingState.RECOVERING


def test_held_slots_whose_workers_have_not_joined_are_not_training_yet() -> None:
    """Workers lease first, then build their models (seconds): only joining the run's generation
    means they train. Until then no bubble can come, so the stall clock must not run. Requests are
    taken while they set up (to be there when the first bubbles open), but only for
    `unready_after_s`: a set-up that runs longer tells clients to come back."""
    g = gate(recovery_s=30.0, unready_after_s=5.0)
    v = g.assess(HELD, now=0.0, joined=False)
    assert v.state is ServingState.JOINING and "set up" in v.reason and v.ready and not v.fail_queued
    assert v.retry_after_s == 0
    assert g.assess(HELD, now=5.0, joined=False).state is ServingState.JOINING
    v = g.assess(HELD, now=5.5, joined=False)  # setting up longer than unready_after_s
    assert v.state is ServingState.STARTING and "setting up" in v.reason and "for 6s" in v.reason
    assert not v.ready and not v.fail_queued  # what was taken keeps waiting
    assert g.assess(HELD, now=20.0, joined=False).state is ServingState.STARTING  # however long it takes
    assert g.assess(HELD, now=21.0).state is ServingState.SERVING  # joined: the first bubble's grace starts
    # a resumption: held again, rejoining: recovering (queued requests kept, new ones refused), not stalled
    v = g.assess(HELD, now=40.0, joined=False)
    assert v.state is ServingState.RECOVERING and not v.ready and not v.fail_queued
    assert g.assess(HELD, now=60.0, joined=False).state is ServingState.RECOVERING
    assert g.assess(HELD, now=61.0).state is ServingState.SERVING


def test_the_set_up_window_starts_again_when_a_slot_is_let_go_before_training() -> None:
    """A worker that leaves during set-up (and is started again) gives the next set-up its own window."""
    g = gate(unready_after_s=5.0)
    assert g.assess(HELD, now=0.0, joined=False).state is ServingState.JOINING
    assert g.assess([HELD[0], SlotView("r0s1", False)], now=4.0).state is ServingState.STARTING
    assert g.assess(HELD, now=8.0, joined=False).state is ServingState.JOINING  # 0 s into the new set-up
    assert g.assess(HELD, now=13.5, joined=False).state is ServingState.STARTING


def test_end_markers_before_training_was_seen_running_are_history() -> None:
    """A restarted compose project: the run id's old markers must not fail the new start."""
    g = gate()
    old = [SlotView("r0s0", True), SlotView("r0s1", False, LeaseState.STOPPED, "stopped yesterday")]
    assert g.assess(old, now=0.0).state is ServingState.STARTING
    # a worker that holds its slot again counts as held, whatever its marker says
    assert g.assess([HELD[0], SlotView("r0s1", True, LeaseState.STOPPED)], now=1.0).ready


def test_disabled_bubbletea_never_serves() -> None:
    v = gate(enabled=False).assess(HELD, now=0.0)
    assert v.state is ServingState.DISABLED and "bubbletea.enabled: false" in v.reason and v.fail_queued


@pytest.mark.parametrize("running_in_open_bubble", [False, True])
def test_fail_waiting_fails_what_waits_and_lets_running_work_finish(running_in_open_bubble: bool) -> None:
    from shared.policies.dispatch_inputs import BubbleOpened

    s = DispatchState(layers=4, max_batch=8)
    if running_in_open_bubble:  # the request goes to the worker whose bubble is open, and runs there
        s.bubble_start(BubbleOpened("w", "addr", predicted_s=10.0, free_memory=1 << 30, started=0.0), now=0.0)
    s.add_request(Request("a", tokens=8, arrival=0.0, kv_bytes=1, ticket="t-a", payload=None), now=0.0)
    out = s.fail_waiting("training finished: run r1 trained all its iterations", now=1.0)
    if running_in_open_bubble:  # held by the worker whose bubble is open: it finishes there
        assert out.failed == () and "a" in s.requests
    else:
        (f,) = out.failed
        assert (f.id, f.ticket, f.reason) == ("a", "t-a", FailureReason.UNAVAILABLE)
        assert "trained all its iterations" in f.detail and s.requests == {}
        assert s.info()["unavailable"] == 1


def test_bubbles_seen_while_unready_ask_for_a_check_at_most_every_bubble_recheck_s() -> None:
    g = ServingGate(run="r", enabled=True, unready_after_s=5.0)
    asked = [g.recheck_due(100.0 + i * 0.001) for i in range(60)]  # 60 bubble starts in 60 ms
    assert asked.count(True) == 2 and asked[0] and (asked[50] or asked[51])  # at 0 and at 50 ms (float sums)
    assert BUBBLE_RECHECK_S == 0.05 and g.recheck_due(100.2)
