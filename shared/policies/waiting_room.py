"""The dispatcher's waiting room (pure): every request it knows, and the queue of those waiting.

A request is known from its arrival until it leaves: answered, failed or moved to the decoder. It
waits here while no worker holds it; a worker's report or loss brings it back. The room keeps:

* every known request by id (`requests`), each on a worker or waiting (`Request.on_worker`);
* the waiting ones in packing order (`packing.WaitingQueue`), their count, and their predicted
  seconds as each was counted when it joined the queue (admission counts them ahead);
* what packing reads (`candidates`) and what the timer expires (`expiring`).

Every entry and exit goes through `admit`, `enqueue`, `back`, `send` and `leave`, so the count and the
seconds never drift from the requests (tests/unit/test_dispatch.py recounts them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic

from shared.policies import prompt_placement as placement
from shared.policies.decisions import P
from shared.policies.dispatch_inputs import Request
from shared.policies.packing import Candidate, WaitingQueue
from shared.policies.prefill_cost import PrefillCostModel


class WaitingRoom(Generic[P]):
    """The known requests and the queue of those waiting. Durations are real seconds."""

    def __init__(self, order: str, cost: PrefillCostModel, layers: int) -> None:
        self.cost, self.layers = cost, layers
        self.requests: dict[str, Request[P]] = {}
        self.queue = WaitingQueue(order)  # the waiting requests' ids in packing order
        self.waiting = 0  # requests on no worker: nothing to pack costs O(1)
        self.queued_s = 0.0  # their predicted seconds, as each was counted when it joined

    def remaining_s(self, req: Request[P]) -> float:
        """The predicted seconds of what `req` has left to run."""
        return self.cost.predict(req.tokens) * (self.layers - req.next_layer) / self.layers

    # --- entries and exits -----------------------------------------------------------------

    def admit(self, req: Request[P]) -> None:
        """`req` is known from now; it waits unless a worker holds it already (adopted)."""
        self.requests[req.id] = req
        self.queue.know(req.id, req.deadline, req.arrival)
        if req.on_worker is None:
            self.enqueue(req)

    def enqueue(self, req: Request[P]) -> None:
        """`req` waits in the queue (again)."""
        self.queue.put(req.id)
        self.waiting += 1
        req.queued_s = self.remaining_s(req)
        self.queued_s += req.queued_s

    def back(self, req: Request[P]) -> None:
        """`req` comes back from its worker (reported unfinished, or its batch lost): it waits."""
        req.on_worker = None
        self.enqueue(req)

    def send(self, req: Request[P], worker: str) -> None:
        """`req` leaves the queue for `worker`."""
        req.on_worker = worker
        self.queue.take(req.id)
        self._dequeued(req)

    def leave(self, req: Request[P]) -> None:
        """`req` is gone for good (answered, failed or moved). One held on a worker stays in its
        batch there (its credit comes back with the batch's report, which then ignores it)."""
        if req.on_worker is None:
            self._dequeued(req)
        del self.requests[req.id]
        self.queue.forget(req.id)

    def _dequeued(self, req: Request[P]) -> None:
        self.waiting -= 1
        self.queued_s = max(0.0, self.queued_s - req.queued_s) if self.waiting else 0.0
        req.queued_s = 0.0

    # --- what packing reads ----------------------------------------------------------------

    def any_live(self, now: float) -> bool:
        """Whether a waiting request has not passed its deadline (reads the queue's head only)."""
        for rid in self.queue:
            d = self.requests[rid].deadline
            if d is None or d >= now:
                return True
        return False

    def offers_any(self, dc: str, now: float) -> bool:
        """Whether a request waiting now may go to a worker in datacenter `dc` (not pinned to another
        DC's saved state, not expired): if not, none of that DC's workers is asked in this pass
        (sending only takes requests away). At 8,192 GPUs a pass with only resumed requests
        pinned elsewhere asked all 1,024 workers to pack the same queue (issue 63)."""
        return any(c.deadline is None or c.deadline >= now for c in self.candidates(dc, now))

    def candidates(self, dc: str, now: float) -> Iterator[Candidate]:
        """The waiting requests a worker in datacenter `dc` may take, in packing order, read lazily
        (packing stops at the plan's end): all but those whose saved state is in another DC and
        may still wait for a worker there (`RESUME_WAIT_S`)."""
        for rid in self.queue:
            r = self.requests[rid]
            if r.state_dc and r.state_dc != dc and now < r.own_dc_until:
                continue
            yield Candidate(r.id, r.tokens, r.next_layer, r.arrival, r.kv_bytes, r.deadline)

    # --- expiry ----------------------------------------------------------------------------

    def moves_at(self, r: Request[P]) -> float | None:
        """By when `r`, if not running in an open bubble, has moved to the decoder (None: it never
        does): its latest start (`prompt_placement.moves_at`); `expiring` moves it at the last tick
        before, as a tick later would eat into the decoder's reserve. A batch item carries it, so
        that a worker whose bubble opened after it leaves the item unrun (`fill.moved_on_worker`),
        and one whose bubble opened before runs it (what runs in an open bubble is not moved)."""
        if not r.may_move or r.objective is None or r.due is None:
            return None
        objective_s = r.objective_s if r.objective_s is not None else 0.0
        return placement.moves_at(r.due, objective_s, self.remaining_s(r), r.decoder_s)

    def not_running(self, running: Callable[[str], bool]) -> list[Request[P]]:
        """Requests not running in an open bubble now (`running`: whether a worker is in one):
        waiting here, or on a worker between bubbles."""
        return [r for r in self.requests.values() if r.on_worker is None or not running(r.on_worker)]

    def expiring(
        self, now: float, tick_s: float, running: Callable[[str], bool]
    ) -> tuple[list[Request[P]], list[Request[P]]]:
        """Of the requests not running in an open bubble, those whose time is up at `now`: (to move
        to the decoder, as their bubble has not come by the last tick before `moves_at`; to fail,
        past their objective or deadline). The caller makes them leave."""
        moved, late = [], []
        for r in self.not_running(running):
            if (moves_at := self.moves_at(r)) is not None and now + tick_s >= moves_at:
                moved.append(r)
            elif r.due is not None and r.due < now:
                late.append(r)
        return moved, late
