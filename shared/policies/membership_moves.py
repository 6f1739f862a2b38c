"""What a worker does next in its run (pure): its membership's record, and the move after an event.

A worker takes part in its run in two phases. **Joining**: it enters a generation, waits for every
slot, forms the data plane's groups and takes the state the run resumes from. **Training**: it
trains until one of seven things happens first (the training ends, its lease is lost, its inbox
crashes, it is told to stop, told to leave, a peer is lost, or the generation moves on).

The shell (`services/stage_worker/membership/take_part.py`) waits for the first event, asks
`next_move`, executes the move and logs it with its why. The rules, in order:

* Joining: joined, train; the generation moved on while the groups formed, join the newer one;
  halted (a stop, a leave), leave or stop; a failed join or a lost lease, fail.
* Training: told to leave, finish the iteration in progress and wait on (said once). Then the
  first that holds of: the training ended (hand the slot over if it left at a step boundary, else
  finish; a training error fails), the lease was lost, the inbox crashed (fail), told to stop
  (stop), leaving (leave now: no boundary to wait for), a peer lost or the generation moved (join
  again, after the loss).

`Membership` holds the state the rules read, in one place: the generation, the iteration it last
stepped, whether the next join follows a loss, whether it is leaving, its phase.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from shared.policies.recovery import FROM_SCRATCH


class Phase(enum.StrEnum):
    JOINING = "joining"  # entering a generation, up to its commit point
    TRAINING = "training"  # the run's iterations, until the first event
    ENDED = "ended"  # it finished, stopped, left or failed: nothing follows


class Event(enum.StrEnum):
    """What ended a wait of the worker's."""

    JOINED = "joined"  # the join committed: train from `Seen.start`
    HALTED = "halted"  # told to stop or leave while it joined (its peers may never come)
    JOIN_FAILED = "join_failed"  # the join cannot complete: `Seen.error` says why
    TRAINED = "trained"  # the training returned: the end, a clean stop, or a step boundary to leave at
    TRAINING_FAILED = "training_failed"  # the training raised
    LEASE_LOST = "lease_lost"  # the lease's watch ended (it raises: a lost lease, a peer stopped)
    INBOX_CRASHED = "inbox_crashed"  # the inbox's consumer stopped on an error
    STOPPED = "stopped"  # the run's stop (a signal, a launcher)
    TOLD_TO_LEAVE = "told_to_leave"  # a drain: SIGTERM alone, `bubbletea drain`
    PEER_LOST = "peer_lost"  # a peer's lease is gone: the run recovers
    MOVED = "moved"  # the generation moved past this worker's (a replacement joined)


class Move(enum.StrEnum):
    JOIN = "join"  # enter a new generation (after a loss: move on from the one it trained in)
    TRAIN = "train"  # train from the join's start
    FINISH_ITERATION = "finish_iteration"  # told to leave: finish the iteration and its step, then decide
    WAIT = "wait"  # nothing new: wait for the next event
    FINISH = "finish"  # trained to the end: flush the sends, mark the slot done, release it
    HAND_OVER = "hand_over"  # left at a step boundary: stop the run, or hand the slot over
    LEAVE_NOW = "leave_now"  # told to leave with no step boundary to wait for
    STOP = "stop"  # told to stop: mark the slot stopped
    FAIL = "fail"  # a failure it cannot ride out: raise it (`Decision.cause` says whose)


#: The moves after which nothing follows.
FINAL = frozenset({Move.FINISH, Move.HAND_OVER, Move.LEAVE_NOW, Move.STOP, Move.FAIL})


@dataclass
class Membership:
    """One worker's membership of its run: the state the rules read, kept in one place."""

    #: The generation it trains in (0: not joined yet).
    generation: int = 0
    #: The iteration it last stepped: what it says as it joins (the state it holds).
    stepped: int = FROM_SCRATCH
    #: The next join follows a loss (or a move): it moves the generation on from `generation`.
    after_loss: bool = False
    #: Told to leave and said so: the training returns at its next step boundary.
    leaving: bool = False
    phase: Phase = Phase.JOINING
    #: The iteration it trains from, once joined.
    start: int = 0

    def entered(self, generation: int) -> None:
        """It entered `generation`: its own, or a newer one a replacement began (as Redis says)."""
        self.generation = generation

    def apply(self, decision: Decision) -> None:
        """The record as `decision` is executed (the shell calls it once per decision)."""
        match decision.move:
            case Move.JOIN:
                self.phase, self.after_loss = Phase.JOINING, True
            case Move.TRAIN:
                self.phase, self.start = Phase.TRAINING, decision.start
            case Move.FINISH_ITERATION:
                self.leaving = True
            case move if move in FINAL:
                self.phase = Phase.ENDED


@dataclass(frozen=True)
class Seen:
    """What ended a wait: every event found done together (`now` is the caller's clock)."""

    events: frozenset[Event]
    #: TRAINED: the iteration it left after (a drain at a step boundary); None: it trained to the end.
    left_after: int | None = None
    #: JOINED: the iteration it trains from.
    start: int = 0
    #: JOIN_FAILED: why.
    error: str = ""

    @classmethod
    def of(cls, *events: Event, left_after: int | None = None, start: int = 0, error: str = "") -> Seen:
        return cls(frozenset(events), left_after, start, error)

    def without(self, done: Iterable[Event]) -> Seen:
        """The same sight, less the events a move already answered."""
        return Seen(self.events - frozenset(done), self.left_after, self.start, self.error)


@dataclass(frozen=True)
class Decision:
    move: Move
    why: str
    at: float  # when it was decided (the caller's clock)
    #: The event whose failure FAIL raises (its task's error, or `why` for a failed join).
    cause: Event | None = None
    #: TRAIN: the iteration to train from.
    start: int = 0
    #: HAND_OVER: the iteration it left after.
    left_after: int | None = None
    #: FAIL of a failed join: the error to raise.
    error: str = ""

    def fields(self) -> dict[str, object]:
        """For the shell's one log line (key=value; `why` is its message)."""
        out: dict[str, object] = {"move": self.move.value}
        if self.cause is not None:
            out["cause"] = self.cause.value
        if self.error:
            out["error"] = self.error
        return out


def next_move(member: Membership, seen: Seen, now: float) -> Decision:
    """The move after `seen`, for a worker whose membership is `member` (not changed here)."""
    if member.phase is Phase.ENDED:
        return Decision(Move.WAIT, "its part in the run has ended", now)
    if member.phase is Phase.JOINING:
        return _joining(member, seen, now)
    return _training(member, seen, now)


def _joining(member: Membership, seen: Seen, now: float) -> Decision:
    ev = seen.events
    if Event.LEASE_LOST in ev:
        return Decision(Move.FAIL, "its lease was lost while it joined", now, Event.LEASE_LOST)
    if Event.JOIN_FAILED in ev:
        return Decision(Move.FAIL, "the join failed", now, Event.JOIN_FAILED, error=seen.error)
    if Event.HALTED in ev:
        if Event.TOLD_TO_LEAVE in ev:
            return Decision(Move.LEAVE_NOW, "told to leave before it trained in this generation", now)
        return Decision(Move.STOP, "stopped before training started", now)
    if Event.MOVED in ev:
        return Decision(Move.JOIN, "the run's generation moved on while its groups formed: joining it", now)
    if Event.JOINED in ev:
        return Decision(Move.TRAIN, "all slots held; training", now, start=seen.start)
    return Decision(Move.WAIT, "still joining", now)


def _training(member: Membership, seen: Seen, now: float) -> Decision:
    ev = seen.events
    if Event.TOLD_TO_LEAVE in ev and not member.leaving:  # at the next step boundary; the pipeline goes on
        return Decision(Move.FINISH_ITERATION, "asked to leave: finishing the iteration in progress", now)
    if Event.TRAINING_FAILED in ev:
        return Decision(Move.FAIL, "the training failed", now, Event.TRAINING_FAILED)
    if Event.TRAINED in ev:
        if seen.left_after is not None:
            return Decision(Move.HAND_OVER, "left the training at a step boundary", now, left_after=seen.left_after)
        return Decision(Move.FINISH, "training finished", now)
    if Event.LEASE_LOST in ev:
        return Decision(Move.FAIL, "its lease's watch ended: lost, or a peer stopped", now, Event.LEASE_LOST)
    if Event.INBOX_CRASHED in ev:
        return Decision(Move.FAIL, "its inbox's consumer crashed", now, Event.INBOX_CRASHED)
    if Event.STOPPED in ev:
        return Decision(Move.STOP, "stopped before the end of training", now)
    lost, moved = Event.PEER_LOST in ev, Event.MOVED in ev
    if (lost or moved) and member.leaving:  # a peer was lost meanwhile: no boundary to wait for
        return Decision(Move.LEAVE_NOW, "told to leave while the run recovered", now)
    if lost:
        return Decision(Move.JOIN, "a peer lost its worker: the run pauses to recover", now)
    if moved:
        return Decision(Move.JOIN, "a replacement joined the run: the run pauses to recover", now)
    return Decision(Move.WAIT, "nothing that ends the training", now)
