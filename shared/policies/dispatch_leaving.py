"""How a request leaves the dispatcher other than answered: refused or moved on arrival, moved to the
decoder or failed at its objective or deadline while it waits, failed when nothing can serve. The
third part of the dispatch policy (`shared.policies.dispatch`'s docstring has the rules); `Leaving`
is mixed into `DispatchState`, whose tables it reads and writes, and holds no state of its own.

Where a prompt goes is `shared.policies.prompt_placement`'s decision; admission's rate
(`shared.policies.admission`) is the prediction it decides on. A move to the decoder travels as a
`Failure` with `FailureReason.TO_DECODER`: the same explicit answer, acked and cleaned up as a
failure is, that the front door reads as "compute it yourself" (it is not counted as a failure).
"""

from __future__ import annotations

from collections.abc import Callable

from shared.policies import prompt_placement as placement
from shared.policies.admission import Admission
from shared.policies.decisions import Failure
from shared.policies.dispatch_inputs import Counts, Credit, Request
from shared.policies.packing import WaitingQueue
from shared.wire.status import FailureReason


class Leaving:
    """Refusals, moves and expiries, over `DispatchState`'s tables (declared for the type checker)."""

    requests: dict[str, Request]
    workers: dict[str, Credit]
    counts: Counts
    _queued_s: float
    _held_s: float
    _queue: WaitingQueue
    _admission: Admission
    _bubble_seen: bool

    @property
    def tick_s(self) -> float:  # DispatchState's: how often the timer comes
        raise NotImplementedError

    def _remaining_s(self, req: Request) -> float:  # dispatch_fill.Filling's
        raise NotImplementedError

    def _dequeued(self, req: Request) -> None:  # dispatch_fill.Filling's
        raise NotImplementedError

    def _placed_elsewhere(self, req: Request, now: float) -> Failure | None:
        """A new request refused (OVERLOADED: a 429) or moved to the decoder (TO_DECODER) on
        arrival, because the bubbles are predicted not to finish it in time; None to queue it."""
        ahead = self._queued_s + self._held_s  # the queue's work, and the workers'
        own = self._remaining_s(req)
        finish_in = self._admission.finish_in(ahead, own, now)
        if req.objective is None:  # a deadline only: admission's margin, as before objectives
            why = self._admission.refusal(ahead, own, req.deadline, now)
            verdict = placement.Verdict(None if why else placement.Where.BUBBLES, why or "")
        else:
            verdict = placement.on_arrival(
                finish_in,
                req.due,
                req.objective_s,
                req.may_move,
                now,
                req.decoder_s,
                self._bubble_seen,
                self._admission.came_round(now),
            )
        if verdict.where is placement.Where.BUBBLES:
            req.predicted_wait_s = self._admission.raw_finish_in(ahead, own, now)  # what corrects the next
            return None
        if verdict.where is placement.Where.DECODER:
            self.counts.moved += 1
            return Failure(req.id, req.ticket, req.payload, FailureReason.TO_DECODER, verdict.why)
        self.counts.overloaded += 1
        why = verdict.why if verdict.why.startswith("overloaded") else f"overloaded: {verdict.why}"
        return Failure(req.id, req.ticket, req.payload, FailureReason.OVERLOADED, why)

    def _waited(self, req: Request, now: float) -> None:
        """`req` is answered, or failed at its due time, at `now`: its real wait corrects admission's
        next predictions (`Admission.waited`)."""
        if req.predicted_wait_s is not None and req.due is not None:
            self._admission.waited(req.predicted_wait_s, now - req.arrival, req.due - req.arrival)

    def _moved_by(self, r: Request) -> float | None:
        """By when `r`, if not running in an open bubble, has moved to the decoder (None: it never
        does): its latest start (`prompt_placement.moves_at`); `_expire` moves it at the last tick
        before, as a tick later would eat into the decoder's reserve. A batch item carries it, so
        that a worker whose bubble opened after it leaves the item unrun (`fill.moved_on_worker`),
        and one whose bubble opened before runs it (what runs in an open bubble is not moved)."""
        if not r.may_move or r.objective is None or r.due is None:
            return None
        objective_s = r.objective_s if r.objective_s is not None else 0.0
        return placement.moves_at(r.due, objective_s, self._remaining_s(r), r.decoder_s)

    def _expire(self, now: float) -> tuple[Failure, ...]:
        """Requests not running in an open bubble whose time is up: moved to the decoder once their
        bubble has not come by the last tick before `_moved_by`, failed past their objective or deadline."""
        moved, late = [], []
        for r in self._not_running():
            if (moved_by := self._moved_by(r)) is not None and now + self.tick_s >= moved_by:
                moved.append(r)
                continue
            if r.due is not None and r.due < now:
                late.append(r)
        self.counts.moved += len(moved)
        self.counts.expired += len(late)
        for r in late:
            self._waited(r, now)
        return self._drop(
            moved, FailureReason.TO_DECODER, lambda r: f"no bubble started it by {now - r.arrival:.3f}s after arrival"
        ) + self._drop(late, FailureReason.DEADLINE, lambda r: r.late(now))

    def _not_running(self) -> list[Request]:
        """Requests not running in an open bubble now: waiting here, or on a worker between bubbles."""
        out = []
        for r in self.requests.values():
            c = self.workers.get(r.on_worker) if r.on_worker is not None else None
            if c is None or c.bubble is None:
                out.append(r)
        return out

    def _drop(
        self, gone: list[Request], reason: FailureReason, detail: Callable[[Request], str]
    ) -> tuple[Failure, ...]:
        """Fail (or move) these requests. One held on a worker stays in its batch there (its credit
        comes back with the batch's report, which then ignores it)."""
        for r in gone:
            if r.on_worker is None:
                self._dequeued(r)
            del self.requests[r.id]
            self._queue.forget(r.id)
        return tuple(Failure(r.id, r.ticket, r.payload, reason, detail(r)) for r in gone)
