"""`shared.runtime.timing.Schedule`: padded work kept on its profiled schedule (the prefill executor's)."""

from __future__ import annotations

import pytest

from shared.runtime.timing import Schedule


def run(schedule: Schedule, start: float, spent: list[float], profiled: float, overshoot: float = 0.0) -> float:
    """Steps that each take `spent[i]` of real work, each started once the previous one is due
    (a wait that wakes `overshoot` late); returns when the real work ended."""
    now = start
    for s in spent:
        if (wait := schedule.wait_s(now)) > 0:
            now += wait + overshoot
        schedule.add(profiled)
        now += s
    return now


def test_steps_that_keep_up_take_exactly_their_profiled_total() -> None:
    sched = Schedule(10.0)
    end = run(sched, 10.0, [0.2, 0.5, 0.9], profiled=1.0)
    assert sched.due == pytest.approx(13.0) and sched.behind(end) == 0.0
    assert sched.wait_s(end) == pytest.approx(0.1)  # the last step's pad


def test_a_slow_step_is_won_back_by_the_slack_of_the_next() -> None:
    # padding each step on its own would give 2 + 1 + 1 = 4 s and 1 s of lag
    sched = Schedule(0.0)
    end = run(sched, 0.0, [2.0, 0.5, 0.5], profiled=1.0)
    assert end == pytest.approx(3.0) and sched.behind(end) == 0.0


def test_work_slower_than_the_profile_on_the_whole_is_behind() -> None:
    sched = Schedule(0.0)
    end = run(sched, 0.0, [2.0, 2.0, 0.5], profiled=1.0)
    assert end == pytest.approx(4.5) and sched.behind(end) == pytest.approx(1.5)


def test_late_wake_ups_are_won_back_too() -> None:
    # every wait wakes 0.2 s late; steps of 0.3 s real work still end on the 1 s schedule
    sched = Schedule(0.0)
    end = run(sched, 0.0, [0.3, 0.3, 0.3], profiled=1.0, overshoot=0.2)
    assert end == pytest.approx(2.5) and sched.behind(end) == 0.0 and sched.due == pytest.approx(3.0)
