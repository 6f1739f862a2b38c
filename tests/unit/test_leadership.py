"""Which dispatcher leads a run (`shared.policies.leadership`): take, renew, stand by, step down."""

import pytest

from shared.policies.leadership import AFTER_END_S, MARGIN_S, RETRY_S, Leadership, Move, Seen
from shared.wire.status import DispatcherRole

TTL_S, RENEW_S = 3.0, 1.0


def leader(at: float = 0.0) -> Leadership:
    """'a', which took the lease with a step sent at `at`."""
    lead = Leadership("a", ttl_s=TTL_S, renew_every_s=RENEW_S)
    assert lead.decide(Seen("a", TTL_S, sent_at=at), at + 0.001).move is Move.LEAD
    return lead


def test_a_standby_takes_a_lease_nobody_holds_and_leads_until_its_end_less_the_margin() -> None:
    lead = Leadership("a", ttl_s=TTL_S, renew_every_s=RENEW_S)
    assert lead.role is DispatcherRole.STANDBY and not lead.leads(0.0)
    d = lead.decide(Seen("a", TTL_S, sent_at=10.0), 10.002)
    assert (d.move, d.leader, d.look_in_s) == (Move.LEAD, "a", RENEW_S)
    assert lead.role is DispatcherRole.LEADER
    assert lead.leads(10.0 + TTL_S - MARGIN_S - 0.001)
    assert not lead.leads(10.0 + TTL_S - MARGIN_S)  # counted from when the take was sent, not heard


def test_a_standby_waits_while_another_leads_and_looks_again_as_its_lease_ends() -> None:
    lead = Leadership("b", ttl_s=TTL_S, renew_every_s=RENEW_S)
    d = lead.decide(Seen("a", 2.5, sent_at=0.0), 0.001)
    assert (d.move, d.leader, d.look_in_s) == (Move.STAND_BY, "a", RENEW_S)  # renewed meanwhile, likely
    assert "a leads" in d.why
    d = lead.decide(Seen("a", 0.3, sent_at=1.0), 1.001)
    assert d.move is Move.STAND_BY and d.look_in_s == pytest.approx(0.3 + AFTER_END_S)  # at its end
    assert not lead.leads(1.001)


def test_a_standby_that_finds_the_lease_gone_after_its_take_steps_again_at_once() -> None:
    d = Leadership("b", ttl_s=TTL_S, renew_every_s=RENEW_S).decide(Seen(None, 0.0, sent_at=0.0), 0.001)
    assert (d.move, d.look_in_s) == (Move.STAND_BY, 0.0)


def test_a_take_heard_of_only_past_its_lease_is_not_acted_on() -> None:
    lead = Leadership("a", ttl_s=TTL_S, renew_every_s=RENEW_S)
    d = lead.decide(Seen("a", TTL_S, sent_at=0.0), TTL_S)  # the process stalled mid-step
    assert d.move is Move.STAND_BY and lead.role is DispatcherRole.STANDBY and d.look_in_s == 0.0


def test_a_leader_renews_every_interval_and_each_renewal_moves_its_lease_on() -> None:
    lead = leader()
    d = lead.decide(Seen("a", TTL_S, sent_at=1.0), 1.002)
    assert (d.move, d.look_in_s) == (Move.KEEP, RENEW_S)
    assert lead.leads(1.0 + TTL_S - MARGIN_S - 0.001) and not lead.leads(1.0 + TTL_S - MARGIN_S)


@pytest.mark.parametrize(
    ("seen", "why"),
    [
        (Seen("b", 2.9, sent_at=1.0), "b holds the lease"),  # taken over: our renewal found another value
        (Seen(None, 0.0, sent_at=1.0), "expired before it was renewed"),  # it ended under us
    ],
)
def test_a_leader_whose_renewal_finds_the_lease_gone_or_anothers_steps_down_at_once(seen: Seen, why: str) -> None:
    lead = leader()
    d = lead.decide(seen, 1.002)
    assert (d.move, d.look_in_s) == (Move.STEP_DOWN, 0.0) and why in d.why
    assert lead.role is DispatcherRole.STANDBY and not lead.leads(1.002)


def test_a_leader_stalled_past_its_lease_steps_down_whatever_redis_says_when_it_resumes() -> None:
    lead = leader()
    resumed = TTL_S - MARGIN_S  # its renewals stopped (SIGSTOP, a GC pause) until its lease ran out
    assert not lead.leads(resumed)  # from this instant it writes nothing (the shell checks `leads`)
    d = lead.decide(Seen("a", TTL_S, sent_at=resumed - 0.001), resumed)  # still ours in Redis, say
    assert d.move is Move.STEP_DOWN and "no renewal confirmed for" in d.why
    assert lead.role is DispatcherRole.STANDBY


def test_a_leader_rides_a_redis_outage_out_within_its_lease_and_steps_down_past_it() -> None:
    lead = leader()
    d = lead.decide(None, 1.0)
    assert d.move is Move.KEEP and lead.leads(1.0) and d.look_in_s == RETRY_S and "did not answer" in d.why
    d = lead.decide(None, TTL_S - MARGIN_S - 0.05)
    assert d.move is Move.KEEP and d.look_in_s == pytest.approx(0.05)  # stepped again before the end
    assert lead.decide(None, TTL_S - MARGIN_S).move is Move.STEP_DOWN


def test_a_standby_waits_through_a_redis_outage() -> None:
    lead = Leadership("b", ttl_s=TTL_S, renew_every_s=RENEW_S)
    d = lead.decide(None, 0.0)
    assert (d.move, d.look_in_s) == (Move.STAND_BY, RETRY_S) and not lead.leads(0.0)


def test_a_leader_told_its_write_was_refused_steps_down_and_may_take_the_lease_again_afresh() -> None:
    lead = leader()
    d = lead.step_down("Redis refused a fenced write: b holds the lease")
    assert (d.move, d.look_in_s) == (Move.STEP_DOWN, 0.0) and not lead.leads(0.5)
    assert lead.decide(Seen("a", TTL_S, sent_at=0.6), 0.601).move is Move.LEAD  # a new term


def test_a_lease_too_short_for_its_renewals_is_refused() -> None:
    with pytest.raises(ValueError, match="no time to renew"):
        Leadership("a", ttl_s=1.0, renew_every_s=1.0)
