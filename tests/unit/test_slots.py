"""The slot arbiter grants real links as the link model shares them: fair at once, temporal one
transfer at a time in workload-aware order (work-conserving when a transfer is window-capped),
fifo in arrival order; a granted transfer is never taken back unless its end never comes (then
reclaimed after a bound the link model sets); every grant says why."""

import pytest

from shared.policies.slots import STALE_FACTOR, STALE_FLOOR_S, SlotArbiter
from shared.policies.wan import LinkModel

FULL = LinkModel(bandwidth=100.0, latency=0.01, flow_cap=100.0)  # one transfer fills the link
QUARTER = LinkModel(bandwidth=100.0, latency=0.01, flow_cap=25.0)  # one transfer: a quarter


def ids(grants: list) -> list[str]:
    return [g.id for g in grants]


def test_temporal_grants_one_at_a_time_in_workload_aware_order() -> None:
    a = SlotArbiter(FULL, "temporal")
    assert ids(a.request("late", 10, (2, 0, 0), 0.0)) == ["late"]  # link free
    assert a.request("mb1", 10, (1, 1, 0), 0.1) == []
    assert a.request("mb0-r1", 10, (1, 0, 1), 0.2) == []
    assert a.request("mb0-r0", 10, (1, 0, 0), 0.3) == []
    assert a.waiting == 3
    # the started transfer is not preempted; then earlier microbatch first, then replica
    assert ids(a.done("late", 1.0)) == ["mb0-r0"]
    assert ids(a.done("mb0-r0", 2.0)) == ["mb0-r1"]
    assert ids(a.done("mb0-r1", 3.0)) == ["mb1"]
    assert a.done("mb1", 4.0) == [] and a.waiting == 0


def test_fifo_grants_in_arrival_order() -> None:
    a = SlotArbiter(FULL, "fifo")
    a.request("x", 10, (5, 0, 0), 0.0)
    a.request("y", 10, (9, 0, 0), 0.1)
    a.request("z", 10, (0, 0, 0), 0.2)
    assert ids(a.done("x", 1.0)) == ["y"]
    assert ids(a.done("y", 2.0)) == ["z"]


def test_fair_grants_everything_at_once() -> None:
    a = SlotArbiter(FULL, "fair")
    got = [g for i in range(3) for g in a.request(f"t{i}", 10, (0, i, 0), 0.0)]
    assert ids(got) == ["t0", "t1", "t2"] and len(a.granted) == 3
    assert "3 transfers share the link" in got[-1].why


def test_temporal_is_work_conserving_when_one_transfer_cannot_fill_the_link() -> None:
    a = SlotArbiter(QUARTER, "temporal")
    got = [g for i in range(6) for g in a.request(f"t{i}", 10, (0, i, 0), 0.0)]
    assert ids(got) == ["t0", "t1", "t2", "t3"]  # four quarter-capped transfers fill it
    assert "window-capped" in got[1].why and "25%" in got[1].why
    assert ids(a.done("t2", 1.0)) == ["t4"]


def test_a_repeated_request_is_granted_again_and_a_queued_one_is_not_duplicated() -> None:
    a = SlotArbiter(FULL, "temporal")
    a.request("x", 10, (0, 0, 0), 0.0)
    a.request("y", 10, (0, 1, 0), 0.0)
    again = a.request("x", 10, (0, 0, 0), 0.5)
    assert ids(again) == ["x"] and "again" in again[0].why
    assert a.request("y", 10, (0, 1, 0), 0.5) == [] and a.waiting == 1
    assert a.done("unknown", 1.0) == []
    assert ids(a.done("x", 1.0)) == ["y"]


def test_every_grant_says_why() -> None:
    a = SlotArbiter(FULL, "temporal")
    (g,) = a.request("x", 10, (3, 1, 0), 0.0)
    assert "link free" in g.why and "workload-aware" in g.why and "[3, 1, 0]" in g.why


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown sharing policy"):
        SlotArbiter(FULL, "random")


def test_a_grant_whose_end_never_comes_is_reclaimed_after_its_bound_and_the_next_is_granted() -> None:
    a = SlotArbiter(FULL, "temporal")
    a.request("lost", 1000, (0, 0, 0), 0.0)  # 10 s alone on the link (+ latency)
    a.request("next", 10, (0, 1, 0), 1.0)
    limit = a.stale_after_s(1000)
    assert limit == pytest.approx(STALE_FLOOR_S + STALE_FACTOR * 10.01)
    kept = a.expire(limit - 0.01)  # granted at 0: not yet stale
    assert kept.reclaimed == [] and kept.grants == [] and "lost" in a.granted
    expiry = a.expire(limit + 0.01)
    assert ids(expiry.reclaimed) == ["lost"] and "never reported done" in expiry.reclaimed[0].why
    assert ids(expiry.grants) == ["next"]
    # the clock of a grant starts when it is granted, not when it was asked for
    assert a.expire(limit + 0.02 + a.stale_after_s(10) - 0.05).reclaimed == []
    assert a.done("lost", limit + 1) == []  # a late end of a reclaimed transfer changes nothing
