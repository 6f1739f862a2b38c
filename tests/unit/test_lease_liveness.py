"""When a spare takes a slot's holder for gone before its lease expires (`shared.policies.lease_liveness`)."""

import pytest

from shared.policies.lease_liveness import GRACE_S, SETTLE_S, HolderSeen, holder_gone

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
