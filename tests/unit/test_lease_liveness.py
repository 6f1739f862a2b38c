"""When a spare takes a slot's holder for gone before its lease expires (`shared.policies.lease_liveness`)."""

import pytest

from shared.policies.lease_liveness import GRACE_S, SETTLE_S, HolderSeen, HolderWatch, holder_gone

RENEW_S = 1.0


@pytest.mark.parametrize(
    ("seen", "gone", "says"),
    [
        # a dead process: no connection, no renewal for longer than an interval and the grace
        (HolderSeen(connected=False, renewed_ago_s=RENEW_S + GRACE_S + 0.01, redis_up_s=3600), True, "closed"),
        (HolderSeen(connected=False, renewed_ago_s=2.9, redis_up_s=SETTLE_S), True, "2.90 s"),
        # connected: alive, however late its renewal (an event loop held up by a long torch call)
        (HolderSeen(connected=True, renewed_ago_s=2.9, redis_up_s=3600), False, "open"),
        # no connection but renewed within an interval and the grace: it may be reconnecting
        (HolderSeen(connected=False, renewed_ago_s=RENEW_S + GRACE_S, redis_up_s=3600), False, "reconnecting"),
        (HolderSeen(connected=False, renewed_ago_s=0.2, redis_up_s=3600), False, "reconnecting"),
        # Redis restarted lately (its leases kept by an append-only file): its clients are reconnecting
        (HolderSeen(connected=False, renewed_ago_s=2.9, redis_up_s=SETTLE_S - 1), False, "up 9 s only"),
    ],
)
def test_a_holder_is_gone_only_with_no_connection_no_recent_renewal_and_a_settled_redis(
    seen: HolderSeen, gone: bool, says: str
) -> None:
    verdict = holder_gone(seen, renew_every_s=RENEW_S)
    assert verdict.gone is gone
    assert says in verdict.why


def test_the_allowances_are_the_callers_to_set() -> None:
    seen = HolderSeen(connected=False, renewed_ago_s=1.5, redis_up_s=2.0)
    assert not holder_gone(seen, renew_every_s=RENEW_S).gone  # Redis up 2 s: not settled
    assert holder_gone(seen, renew_every_s=RENEW_S, settle_s=0).gone
    assert not holder_gone(seen, renew_every_s=RENEW_S, settle_s=0, grace_s=0.6).gone


def gone_since(renewed_at: float, now: float) -> HolderSeen:
    return HolderSeen(connected=False, renewed_ago_s=now - renewed_at, redis_up_s=3600)


def test_a_spare_takes_a_holder_for_gone_only_on_two_looks_a_renewal_apart() -> None:
    """Issue 62: one look took a live holder for gone (its connection closed under it, and a stall past
    the grace); it must be gone in two looks a renewal interval apart, not renewed between."""
    w = HolderWatch(RENEW_S)
    w.server("r1", now=100.0)
    assert not w.judge("s", "h", gone_since(98.0, 100.0), 100.0).gone  # the first look: a suspect
    assert not w.judge("s", "h", gone_since(98.0, 100.6), 100.6).gone  # 0.6 s later: not yet
    verdict = w.judge("s", "h", gone_since(98.0, 101.0), 101.0)
    assert verdict.gone and "twice, 1.00 s apart" in verdict.why


def test_a_renewal_between_two_looks_or_another_holder_starts_the_count_again() -> None:
    w = HolderWatch(RENEW_S)
    w.server("r1", now=100.0)
    assert not w.judge("s", "h", gone_since(98.0, 100.0), 100.0).gone
    assert not w.judge("s", "h", gone_since(99.5, 101.0), 101.0).gone  # it renewed meanwhile (stalled)
    assert not w.judge("s", "h2", gone_since(99.5, 102.0), 102.0).gone  # another holder took the slot
    assert w.judge("s", "h2", gone_since(99.5, 103.0), 103.0).gone


def test_another_redis_server_or_the_spares_own_reconnect_restarts_the_settle_window() -> None:
    """A failover's new primary has been up long (its uptime says nothing of its clients); a spare
    whose own connection broke sees everyone else reconnecting too."""
    w = HolderWatch(RENEW_S)
    w.server("primary", now=100.0)
    w.judge("s", "h", gone_since(98.0, 100.0), 100.0)
    w.server("replica-promoted", now=101.0)  # a failover: what was seen before is forgotten
    for t in (101.0, 102.0, 105.0, 110.9):
        assert "up" in w.judge("s", "h", gone_since(98.0, t), t).why  # settling for SETTLE_S
    assert not w.judge("s", "h", gone_since(98.0, 111.5), 111.5).gone  # settled: a first look
    assert w.judge("s", "h", gone_since(98.0, 112.5), 112.5).gone
    w.lost_sight()
    w.server("replica-promoted", now=113.0)  # the same server, but the spare reconnected
    assert "up" in w.judge("s", "h", gone_since(98.0, 114.0), 114.0).why


def test_the_second_look_is_due_a_renewal_interval_after_the_first() -> None:
    w = HolderWatch(RENEW_S)
    w.server("r1", now=100.0)
    assert w.second_look_at() is None
    w.judge("a", "h", gone_since(98.0, 100.0), 100.0)
    w.judge("b", "h2", gone_since(98.0, 100.3), 100.3)
    assert w.second_look_at() == 101.0
