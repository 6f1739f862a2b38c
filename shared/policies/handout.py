"""What goes where (pure): the dispatcher hands the waiting requests out to the workers with room.

One pass (`Handout.fill`) offers the waiting room (`waiting_room.WaitingRoom`) to the roomiest
worker of the credit book (`credit_book.CreditBook`), one batch at a time, then to the next
roomiest, until nothing waits or nobody takes anything. A batch takes at most half its worker's
window, so a finished batch is topped up while the next one runs. Packing is
`packing.pack_ordered` with the learned cost model. `shared.policies.dispatch`'s docstring has the
rules; tests/unit/test_dispatch.py checks the pass against a full scan of every worker.
"""

from __future__ import annotations

import math
from typing import Generic

from shared.policies.credit_book import CreditBook
from shared.policies.decisions import NOTHING, Batch, BatchItem, Decisions, P, Trigger, Why
from shared.policies.dispatch_inputs import Counts, Credit
from shared.policies.packing import Assignment, layered_cost, pack_ordered
from shared.policies.prefill_cost import PrefillCostModel
from shared.policies.waiting_room import WaitingRoom


class Handout(Generic[P]):
    """Fill passes over a waiting room and a credit book; batches are numbered in `counts`."""

    def __init__(
        self,
        room: WaitingRoom[P],
        book: CreditBook,
        *,
        layers: int,
        cost: PrefillCostModel,
        max_batch: int,
        batch_prefix: str,
        counts: Counts,
    ) -> None:
        self.room, self.book, self.counts = room, book, counts
        self.layers, self.cost, self.max_batch, self.batch_prefix = layers, cost, max_batch, batch_prefix
        self._clock = -math.inf  # the latest `now` of a pass: time going back rebuilds the index

    def fill(self, now: float, trigger: Trigger) -> Decisions[P]:
        """Offer the waiting requests to the workers with room, the roomiest first, one batch at a
        time, until nothing waits or no worker takes anything. Visits only indexed workers: the
        others have no room (the same decisions as visiting all of them)."""
        room, book = self.room, self.book
        if not room.waiting:  # nothing to pack
            return NOTHING
        if now < self._clock:  # time went back: a worker left out as not recent may be again
            book.rebuild_index()
        self._clock = now
        if not room.any_live(now):  # every waiting request has expired: nothing is packed anywhere
            return NOTHING
        batches: list[Batch[P]] = []
        skipped = 0  # the index's head: workers that took nothing in this pass (`CreditIndex.first`)
        barren: dict[str, bool] = {}  # per datacenter: nothing waiting may go there (`offers_any`)
        while room.waiting:
            c = book.first(skipped)
            if c is None:
                break
            if not book.recent(c, now):  # out until its next bubble event
                book.leave_out(c)
                continue
            if c.dc not in barren:
                barren[c.dc] = not room.offers_any(c.dc, now)
            batch = None if barren[c.dc] else self.fill_worker(c, now, trigger)
            if batch is None:  # nothing it may take now (memory, datacenter): the next one
                skipped += 1
                continue
            batches.append(batch)
        return Decisions(batches=tuple(batches)) if batches else NOTHING

    def fill_worker(self, c: Credit, now: float, trigger: Trigger) -> Batch[P] | None:
        """One batch for `c`: at most half its window (so it holds two or more batches, and a
        finished one is topped up while the next runs) and at most its room."""
        window = self.book.window_s(c)
        room = min(window - c.held_s, window / 2)
        if room <= 0:
            return None
        plan = pack_ordered(
            self.room.candidates(c.dc, now),
            room_s=room,
            free_memory=c.free_memory - c.held_bytes,
            layers=self.layers,
            cost=layered_cost(self.cost.predict, self.layers),
            now=now,
            max_requests=self.max_batch,
        )
        if not plan.assignments:
            return None
        predicted = sum(a.seconds for a in plan.assignments)
        why = Why(trigger, c.bubble.tag if c.bubble else None, window, c.held_s, predicted, self.room.waiting)
        return self._send(c, plan.assignments, why, now)

    def _send(self, c: Credit, plan: tuple[Assignment, ...], why: Why, now: float) -> Batch[P]:
        """The batch of `plan` for `c`: its requests marked there, its credit held, it in flight."""
        items, kv_bytes = [], 0
        for a in plan:
            r = self.room.requests[a.id]
            self.room.send(r, c.worker)
            moves_at = self.room.moves_at(r)
            items.append(BatchItem(a.id, r.payload, a.from_layer, a.to_layer, a.seconds, r.due, moves_at))
            kv_bytes += r.kv_bytes
        self.counts.batches += 1
        batch = Batch(f"{self.batch_prefix}-{self.counts.batches}", c.worker, c.address, tuple(items), why)
        self.book.hold(c, batch.batch_id, tuple(a.id for a in plan), batch.predicted_s, kv_bytes, now)
        return batch
