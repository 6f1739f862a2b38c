"""shared/policies/membership_moves.py: every move with its why, the order of the rules, the record."""

from __future__ import annotations

import pytest

from shared.policies.membership_moves import (
    FINAL,
    Decision,
    Event,
    Membership,
    Move,
    Phase,
    Seen,
    next_move,
)
from shared.policies.recovery import FROM_SCRATCH

NOW = 12.5


def joining(*, after_loss: bool = False, generation: int = 3) -> Membership:
    return Membership(generation=generation, after_loss=after_loss)


def training(*, leaving: bool = False) -> Membership:
    return Membership(generation=3, phase=Phase.TRAINING, start=5, leaving=leaving)


def decide(
    member: Membership, *events: Event, left_after: int | None = None, start: int = 0, error: str = ""
) -> Decision:
    return next_move(member, Seen.of(*events, left_after=left_after, start=start, error=error), NOW)


# --- joining ---------------------------------------------------------------------------------


def test_a_committed_join_trains_from_its_start() -> None:
    d = decide(joining(), Event.JOINED, start=8)
    assert (d.move, d.why, d.start, d.at) == (Move.TRAIN, "all slots held; training", 8, NOW)


def test_a_join_halted_by_a_stop_stops() -> None:
    d = decide(joining(), Event.HALTED)
    assert (d.move, d.why) == (Move.STOP, "stopped before training started")


def test_a_join_halted_by_a_leave_leaves_now() -> None:
    d = decide(joining(), Event.HALTED, Event.TOLD_TO_LEAVE)
    assert (d.move, d.why) == (Move.LEAVE_NOW, "told to leave before it trained in this generation")


def test_a_generation_moved_while_the_groups_formed_joins_the_newer_one() -> None:
    d = decide(joining(), Event.MOVED)
    assert (d.move, d.why) == (Move.JOIN, "the run's generation moved on while its groups formed: joining it")


def test_a_failed_join_fails_with_its_error() -> None:
    d = decide(joining(), Event.JOIN_FAILED, error="slot r0s1 could not join the data plane")
    assert (d.move, d.why, d.cause, d.error) == (
        Move.FAIL,
        "the join failed",
        Event.JOIN_FAILED,
        "slot r0s1 could not join the data plane",
    )
    assert d.fields() == {"move": "fail", "cause": "join_failed", "error": "slot r0s1 could not join the data plane"}


def test_a_lease_lost_while_joining_fails_first() -> None:
    d = decide(joining(), Event.LEASE_LOST, Event.HALTED)
    assert (d.move, d.why, d.cause) == (Move.FAIL, "its lease was lost while it joined", Event.LEASE_LOST)


def test_a_join_with_nothing_seen_waits() -> None:
    assert decide(joining()).move is Move.WAIT


# --- training --------------------------------------------------------------------------------


def test_told_to_leave_finishes_the_iteration_first_whatever_came_with_it() -> None:
    for other in (Event.TRAINED, Event.PEER_LOST, Event.STOPPED):
        d = decide(training(), Event.TOLD_TO_LEAVE, other)
        assert (d.move, d.why) == (Move.FINISH_ITERATION, "asked to leave: finishing the iteration in progress")


def test_told_to_leave_again_is_said_once() -> None:
    assert decide(training(leaving=True), Event.TOLD_TO_LEAVE).move is Move.WAIT


def test_training_to_the_end_finishes() -> None:
    d = decide(training(), Event.TRAINED)
    assert (d.move, d.why, d.left_after) == (Move.FINISH, "training finished", None)


def test_training_that_left_at_a_step_boundary_hands_the_slot_over() -> None:
    d = decide(training(leaving=True), Event.TRAINED, left_after=6)
    assert (d.move, d.why, d.left_after) == (Move.HAND_OVER, "left the training at a step boundary", 6)


def test_a_training_error_fails() -> None:
    d = decide(training(), Event.TRAINING_FAILED, Event.LEASE_LOST)
    assert (d.move, d.why, d.cause) == (Move.FAIL, "the training failed", Event.TRAINING_FAILED)


def test_a_lost_lease_fails() -> None:
    d = decide(training(), Event.LEASE_LOST, Event.INBOX_CRASHED, Event.PEER_LOST)
    assert (d.move, d.cause) == (Move.FAIL, Event.LEASE_LOST)
    assert d.why == "its lease's watch ended: lost, or a peer stopped"


def test_a_crashed_inbox_fails() -> None:
    d = decide(training(), Event.INBOX_CRASHED, Event.STOPPED)
    assert (d.move, d.why, d.cause) == (Move.FAIL, "its inbox's consumer crashed", Event.INBOX_CRASHED)


def test_a_stop_stops_before_a_recovery() -> None:
    d = decide(training(), Event.STOPPED, Event.PEER_LOST)
    assert (d.move, d.why) == (Move.STOP, "stopped before the end of training")


@pytest.mark.parametrize("event", [Event.PEER_LOST, Event.MOVED])
def test_a_leaving_worker_leaves_now_when_the_run_recovers(event: Event) -> None:
    d = decide(training(leaving=True), event)
    assert (d.move, d.why) == (Move.LEAVE_NOW, "told to leave while the run recovered")


def test_a_lost_peer_joins_again() -> None:
    d = decide(training(), Event.PEER_LOST, Event.MOVED)
    assert (d.move, d.why) == (Move.JOIN, "a peer lost its worker: the run pauses to recover")


def test_a_moved_generation_joins_again() -> None:
    d = decide(training(), Event.MOVED)
    assert (d.move, d.why) == (Move.JOIN, "a replacement joined the run: the run pauses to recover")


def test_training_with_nothing_seen_waits() -> None:
    assert decide(training()).move is Move.WAIT


def test_an_ended_part_moves_no_more() -> None:
    ended = Membership(phase=Phase.ENDED)
    assert decide(ended, Event.PEER_LOST, Event.JOINED).move is Move.WAIT


def test_the_policy_does_not_change_the_record() -> None:
    member = training()
    before = Membership(**vars(member))
    decide(member, Event.TOLD_TO_LEAVE)
    decide(member, Event.PEER_LOST)
    assert member == before


# --- the record ------------------------------------------------------------------------------


def test_a_new_record_has_joined_nothing() -> None:
    m = Membership()
    assert (m.generation, m.stepped, m.after_loss, m.leaving, m.phase, m.start) == (
        0,
        FROM_SCRATCH,
        False,
        False,
        Phase.JOINING,
        0,
    )


def test_the_record_enters_the_generation_redis_gave_it() -> None:
    m = Membership()
    m.entered(2)
    m.entered(5)  # a replacement began a newer one
    assert m.generation == 5


def test_the_record_follows_a_part_through_its_moves() -> None:
    m = Membership(generation=1)
    m.apply(decide(m, Event.JOINED, start=0))
    assert (m.phase, m.start, m.after_loss) == (Phase.TRAINING, 0, False)
    m.apply(decide(m, Event.PEER_LOST))  # the run recovers: the next join follows a loss
    assert (m.phase, m.after_loss) == (Phase.JOINING, True)
    m.apply(decide(m, Event.JOINED, start=7))
    assert (m.phase, m.start) == (Phase.TRAINING, 7)
    m.apply(decide(m, Event.TOLD_TO_LEAVE))
    assert m.leaving and m.phase is Phase.TRAINING
    m.apply(decide(m, Event.TRAINED, left_after=7))
    assert m.phase is Phase.ENDED


@pytest.mark.parametrize("move", sorted(FINAL))
def test_every_final_move_ends_the_part(move: Move) -> None:
    m = training()
    m.apply(Decision(move, "why", NOW))
    assert m.phase is Phase.ENDED


def test_waiting_changes_nothing() -> None:
    m = training()
    m.apply(Decision(Move.WAIT, "why", NOW))
    assert m == training()


def test_seen_without_keeps_the_rest() -> None:
    seen = Seen.of(Event.TOLD_TO_LEAVE, Event.TRAINED, left_after=4)
    rest = seen.without({Event.TOLD_TO_LEAVE})
    assert rest == Seen.of(Event.TRAINED, left_after=4)
