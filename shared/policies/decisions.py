"""What the dispatch policy decides, as values: the service executes them and logs each one's why.

`DispatchState` (shared/policies/dispatch.py) returns a `Decisions` from every entry point; the
dispatcher service sends its batches, answers its failures and moves, acks the requests it
finished, and writes one log line per decision from the `why` it carries. The simulator consumes
the same values. They are generic in `P`, what the caller attached to each request (the
dispatcher's `PrefillRequest`, the simulator's `SimRequest`): it comes back typed.

Tested by: tests/unit/test_dispatch.py, tests/unit/test_sim.py, tests/unit/test_credit_agreement.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shared.wire.status import FailureReason

#: What the caller attached to a request (its wire message), passed through to its decisions.
P = TypeVar("P")


class Trigger(enum.StrEnum):
    """What made the policy decide."""

    BUBBLE_START = "bubble_start"  # a worker announced a bubble: its credit grows by that bubble
    BUBBLE_END = "bubble_end"  # a bubble ended: what it used comes back as credit
    JOINED = "joined"  # a worker joined the run: it gets its first credit
    REQUEST = "request"  # requests arrived: workers with credit to spare take them
    REPORT = "report"  # a worker reported a batch: its credit and requests are free again
    TICK = "tick"  # the timer: deadlines passed, batches lost


@dataclass(frozen=True)
class BatchItem(Generic[P]):
    """One request's share of a batch: run blocks [from_layer, to_layer), predicted `seconds`."""

    id: str
    payload: P  # what the service attached to the request (the wire message), passed through
    from_layer: int
    to_layer: int
    seconds: float
    #: when its prompt is due (its objective or deadline, the sooner; None: never): a worker that
    #: comes to it later fails it (`fill.late_on_worker`)
    due: float | None = None
    #: by when the dispatcher has moved it to the decoder if it was not running (None: never): a
    #: worker whose bubble opened after that leaves it unrun (`fill.moved_on_worker`)
    moves_from: float | None = None


@dataclass(frozen=True)
class Why:
    """Why a batch went where it went: enough to answer the question after the fact."""

    trigger: Trigger
    bubble: object  # the worker's open bubble (its (iteration, position) tag), None if none was open
    window_s: float  # the credit the worker may hold (its typical bubbles, plus an open bubble's length)
    held_s: float  # predicted seconds it held already
    predicted_s: float  # the batch's predicted prefill time (from the room: window - held)
    queued: int  # requests waiting when it was packed

    @property
    def room_s(self) -> float:
        return max(0.0, self.window_s - self.held_s)

    def fields(self) -> dict[str, object]:
        """For the service's one log line (key=value)."""
        return {
            "trigger": self.trigger.value,
            "bubble": self.bubble,
            "window_ms": round(self.window_s * 1000, 2),
            "held_ms": round(self.held_s * 1000, 2),
            "predicted_ms": round(self.predicted_s * 1000, 2),
            "queued": self.queued,
        }


@dataclass(frozen=True)
class Batch(Generic[P]):
    """Send `items` to `worker` at `address`: it queues them for its bubbles."""

    batch_id: str
    worker: str
    address: str
    items: tuple[BatchItem[P], ...]
    why: Why

    @property
    def predicted_s(self) -> float:
        return sum(i.seconds for i in self.items)


@dataclass(frozen=True)
class Failure(Generic[P]):
    """Fail request `id` explicitly (answer it with `reason`), then ack its `ticket`."""

    id: str
    ticket: str
    payload: P
    reason: FailureReason
    detail: str


@dataclass(frozen=True)
class Moved(Generic[P]):
    """Request `id` goes to the decoder: the bubbles cannot compute it by its objective. Answer it
    as moved (the front door has the decoder compute it), then ack its `ticket`. Not a failure."""

    id: str
    ticket: str
    payload: P
    why: str


@dataclass(frozen=True)
class Finished:
    """Request `id` was answered by a worker: ack its `ticket`."""

    id: str
    ticket: str


@dataclass(frozen=True)
class LostBatch:
    """A batch whose report never came: its requests were queued again, its worker presumed gone."""

    batch_id: str
    worker: str
    requests: int
    overdue_s: float


@dataclass(frozen=True)
class Spent:
    """The partial prefill of request `id` saved at `layer` is used up: no batch resumes from it
    again (the request moved past it, or is answered), so its stored state can go.

    Only an accepted report spends one. A worker still running a batch the policy gave up on
    (declared lost while its worker only paused) resumes from the same saved state as the batch
    that replaced it: if that stale run deleted the state, the live one would find it gone."""

    id: str
    layer: int


@dataclass(frozen=True)
class Ignored:
    """An input that changed nothing, and why (a stale bubble event, an unknown batch's report)."""

    what: str
    why: str


@dataclass(frozen=True)
class Decisions(Generic[P]):
    batches: tuple[Batch[P], ...] = ()
    failed: tuple[Failure[P], ...] = ()
    finished: tuple[Finished, ...] = ()
    lost: tuple[LostBatch, ...] = ()
    ignored: tuple[Ignored, ...] = ()
    spent: tuple[Spent, ...] = ()
    moved: tuple[Moved[P], ...] = ()

    def __add__(self, other: Decisions[P]) -> Decisions[P]:
        if other is NOTHING:  # most inputs decide nothing more: no copy of what was decided
            return self
        if self is NOTHING:
            return other
        return Decisions(
            self.batches + other.batches,
            self.failed + other.failed,
            self.finished + other.finished,
            self.lost + other.lost,
            self.ignored + other.ignored,
            self.spent + other.spent,
            self.moved + other.moved,
        )

    def __bool__(self) -> bool:
        return bool(
            self.batches or self.failed or self.finished or self.lost or self.ignored or self.spent or self.moved
        )


#: No decision: what most inputs return. One value serves them all (`Decisions` is immutable), and
#: adding it copies nothing: a simulated 8,192-GPU iteration feeds the dispatcher ~60,000 inputs.
NOTHING: Decisions[Any] = Decisions()
