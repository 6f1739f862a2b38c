"""What goes where: the half of the dispatch policy that keeps work queued on the workers (their
credit) from the waiting requests (`shared.policies.dispatch`'s module docstring has the rules),
and the index of the workers with credit to spare. `Filling` is mixed into `DispatchState`, whose
tables it reads and writes; it holds no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from shared.policies.decisions import NOTHING, Batch, BatchItem, Decisions, Ignored, Trigger, Why
from shared.policies.dispatch_index import CreditIndex
from shared.policies.dispatch_inputs import Adopted, Counts, Credit, InFlight, Request
from shared.policies.packing import Assignment, Candidate, WaitingQueue, layered_cost, pack_ordered
from shared.policies.prefill_cost import PrefillCostModel


class Filling:
    """Credit and packing, over `DispatchState`'s tables (declared here for the type checker)."""

    layers: int
    max_batch: int
    cost: PrefillCostModel
    credit_bubbles: float
    max_credit_s: float
    hold_s: float
    batch_prefix: str
    stage_window_s: float
    batch_grace_s: float
    requests: dict[str, Request]
    workers: dict[str, Credit]
    in_flight: dict[str, InFlight]
    counts: Counts
    _waiting: int
    _queued_s: float  # predicted seconds waiting here, as each was counted when it joined the queue
    _held_s: float  # predicted seconds held on every worker, summed (admission counts it ahead)
    _held_n: int  # batches held on every worker
    _queue: WaitingQueue
    _index: CreditIndex
    _clock: float
    _adopted: dict[str, tuple[str, int]]  # request id -> (worker, layer) of an adopted batch's
    #: dispatch_leaving.Leaving's (annotated only, so that its method is found past this class)
    _moved_by: Callable[[Request], float | None]

    # --- the queue's accounting ------------------------------------------------------------

    def _remaining_s(self, req: Request) -> float:
        """The predicted seconds of what `req` has left to run."""
        return self.cost.predict(req.tokens) * (self.layers - req.next_layer) / self.layers

    def _enqueue(self, req: Request) -> None:
        """`req` waits in the queue (again)."""
        self._queue.put(req.id)
        self._waiting += 1
        req.queued_s = self._remaining_s(req)
        self._queued_s += req.queued_s

    def _dequeued(self, req: Request) -> None:
        """`req` left the queue (sent to a worker, or failed); the queue's own `take`/`forget` is
        the caller's."""
        self._waiting -= 1
        self._queued_s = max(0.0, self._queued_s - req.queued_s) if self._waiting else 0.0
        req.queued_s = 0.0

    # --- credit ----------------------------------------------------------------------------

    def window_s(self, c: Credit) -> float:
        """The work `c` may hold: `credit_bubbles` of its typical bubble (at most `max_credit_s`),
        plus the predicted length of a bubble open there now (it runs that much more)."""
        window = min(self.max_credit_s, self.credit_bubbles * c.typical_s())
        return window + (c.bubble.predicted_s if c.bubble is not None else 0.0)

    def room_s(self, c: Credit) -> float:
        """Credit `c` has to spare: its window less the work it holds."""
        return self.window_s(c) - c.held_s

    def _reindex(self, c: Credit) -> None:
        if c.off is not None:  # takes no prefill: never offered any
            self._index.discard(c.worker)
            return
        self._index.update(c.worker, self.room_s(c))

    def _release(self, c: Credit, batch_id: str) -> None:
        """The batch is used (or gone): its credit is `c`'s to spare again."""
        got = c.held.get(batch_id)
        if got is None:
            return
        c.release(batch_id)
        self._held_n -= 1
        self._held_s = max(0.0, self._held_s - got[0]) if self._held_n else 0.0  # no float drift left

    def _rebuild_index(self) -> None:
        """Every worker back in the index by its room (time went back: a worker left out for not
        having had a bubble recently may be recent again)."""
        self._index.clear()
        for c in self.workers.values():
            self._reindex(c)

    # --- filling ---------------------------------------------------------------------------

    def _fill_all(self, now: float, trigger: Trigger) -> Decisions:
        """Offer the waiting requests to the workers with room, the roomiest first, one batch at a
        time, until nothing waits or no worker takes anything. Visits only indexed workers: the
        others have no room (the same decisions as visiting all of them)."""
        if not self._waiting:  # nothing to pack
            return NOTHING
        if now < self._clock:  # time went back: a worker left out as not recent may be again
            self._rebuild_index()
        self._clock = now
        if not self._any_live(now):  # every waiting request has expired: nothing is packed anywhere
            return NOTHING
        batches: list[Batch] = []
        skipped = 0  # the index's head: workers that took nothing in this pass (`CreditIndex.first`)
        barren: dict[str, bool] = {}  # per datacenter: nothing waiting may go there (`_offers_any`)
        while self._waiting:
            worker = self._index.first(skipped)
            if worker is None:
                break
            c = self.workers[worker]
            if now - c.last_seen > self.stage_window_s:  # out until its next bubble event
                self._index.discard(worker)
                continue
            if c.dc not in barren:
                barren[c.dc] = not self._offers_any(c.dc, now)
            batch = None if barren[c.dc] else self._fill_worker(c, now, trigger)
            if batch is None:  # nothing it may take now (memory, datacenter): the next one
                skipped += 1
                continue
            batches.append(batch)
        return Decisions(batches=tuple(batches)) if batches else NOTHING

    def _fill_worker(self, c: Credit, now: float, trigger: Trigger) -> Batch | None:
        """One batch for `c`: at most half its window (so it holds two or more batches, and a
        finished one is topped up while the next runs) and at most its room."""
        window = self.window_s(c)
        room = min(window - c.held_s, window / 2)
        if room <= 0:
            return None
        plan = pack_ordered(
            self._candidates(c.dc, now),
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
        why = Why(trigger, c.bubble.tag if c.bubble else None, window, c.held_s, predicted, self._waiting)
        return self._send(c, plan.assignments, why, now)

    def _any_live(self, now: float) -> bool:
        """Whether a waiting request has not passed its deadline (reads the queue's head only)."""
        for rid in self._queue:
            d = self.requests[rid].deadline
            if d is None or d >= now:
                return True
        return False

    def _offers_any(self, dc: str, now: float) -> bool:
        """Whether a request waiting now may go to a worker in datacenter `dc` (not pinned to another
        DC's saved state, not expired): if not, none of that DC's workers is asked in this pass
        (sending only takes requests away). At 8,192 GPUs a pass with only resumed requests
        pinned elsewhere asked all 1,024 workers to pack the same queue (issue 63)."""
        return any(c.deadline is None or c.deadline >= now for c in self._candidates(dc, now))

    def _candidates(self, dc: str, now: float) -> Iterator[Candidate]:
        """The waiting requests a worker in datacenter `dc` may take, in packing order, read lazily
        (packing stops at the plan's end): all but those whose saved state is in another DC and
        may still wait for a worker there (`RESUME_WAIT_S`)."""
        for rid in self._queue:
            r = self.requests[rid]
            if r.state_dc and r.state_dc != dc and now < r.own_dc_until:
                continue
            yield Candidate(r.id, r.tokens, r.next_layer, r.arrival, r.kv_bytes, r.deadline)

    def _send(self, c: Credit, plan: tuple[Assignment, ...], why: Why, now: float) -> Batch:
        """The batch of `plan` for `c`: its requests marked there, its credit held, it in flight."""
        items, kv_bytes = [], 0
        for a in plan:
            r = self.requests[a.id]
            r.on_worker = c.worker
            self._queue.take(a.id)
            self._dequeued(r)
            items.append(BatchItem(a.id, r.payload, a.from_layer, a.to_layer, a.seconds, r.due, self._moved_by(r)))
            kv_bytes += r.kv_bytes
        self.counts.batches += 1
        batch = Batch(f"{self.batch_prefix}-{self.counts.batches}", c.worker, c.address, tuple(items), why)
        ahead_s = c.held_s  # the work it holds already: its queue runs in arrival order
        c.hold(batch.batch_id, batch.predicted_s, kv_bytes)
        self._held_n += 1
        self._held_s += batch.predicted_s
        # The worker may keep it queued up to `hold_s` before a bubble takes it, behind what it holds
        # (issue 62: without `ahead_s` a live worker with a long queue was written off), then run it.
        report_by = now + self.hold_s + ahead_s + batch.predicted_s + self.batch_grace_s
        self.in_flight[batch.batch_id] = InFlight(c.worker, tuple(a.id for a in plan), report_by)
        self._reindex(c)
        return batch

    # --- taking over -----------------------------------------------------------------------

    def adopt(self, b: Adopted, now: float) -> Decisions:
        """A batch an earlier dispatcher of the run sent, that its worker still holds: counted in
        the worker's credit and in flight as if sent now (its report is this dispatcher's to take,
        or its loss), and its requests marked there as they come back (`add_requests`), not sent
        a second time. The worker gets no credit from it: only its next bubble event gives some."""
        if b.batch_id in self.in_flight:
            return Decisions(ignored=(Ignored(f"batch {b.batch_id}", "already in flight"),))
        c = self.workers.setdefault(b.worker, Credit(b.worker))
        c.address = c.address or b.address
        seconds = sum(s for _, _, s in b.items)
        ahead_s = c.held_s
        c.hold(b.batch_id, seconds, b.kv_bytes)
        self._held_n += 1
        self._held_s += seconds
        report_by = now + self.hold_s + ahead_s + seconds + self.batch_grace_s
        self.in_flight[b.batch_id] = InFlight(b.worker, tuple(rid for rid, _, _ in b.items), report_by)
        for rid, layer, _ in b.items:
            self._adopted[rid] = (b.worker, layer)
        self._reindex(c)
        return Decisions()
