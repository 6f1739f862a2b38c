"""The dispatcher's credit book (pure): each worker's credit, and the batches it holds.

A worker may hold about `credit_bubbles` of its typical bubble of predicted prefill, more while a
bubble is open there: its window. What it holds counts against it from the batch's sending until
its use is known; its room is the window less that. The book keeps, in one place:

* each worker's record (`Credit`): its address, datacenter, bubbles and the batches it holds;
* the batches in flight (`InFlight`): whose they are, and by when a report is due; of those an
  earlier dispatcher sent (`adopt`), the requests not yet come back;
* the index of the workers with room (`CreditIndex`), and the open bubbles' stuck times
  (`OpenBubbles`);
* the credit held on every worker, summed (admission counts it ahead of a new request).

Every change of a worker's room goes through `reindex`, so the index never lags the records.
`shared.policies.dispatch`'s docstring has the rules; tests/unit/test_dispatch.py pins them.
"""

from __future__ import annotations

from collections.abc import Iterator

from shared.policies.decisions import Ignored
from shared.policies.dispatch_index import CreditIndex, OpenBubbles
from shared.policies.dispatch_inputs import Adopted, Bubble, Credit, InFlight


class CreditBook:
    """Each worker's credit and the batches it holds. Durations are real seconds."""

    def __init__(
        self,
        *,
        credit_bubbles: float,
        max_credit_s: float,
        hold_s: float,
        stage_window_s: float,
        batch_grace_s: float,
    ) -> None:
        self.credit_bubbles = credit_bubbles  # work held on a worker, in its typical bubbles
        self.max_credit_s = max_credit_s  # at most this much work held on one worker
        self.hold_s = hold_s  # how long a worker may keep work no bubble took
        self.stage_window_s = stage_window_s  # credit only for a worker heard from this recently
        self.batch_grace_s = batch_grace_s  # a report this late past its batch's last run: lost
        self.workers: dict[str, Credit] = {}
        #: batch id -> the batch sent and not yet reported (or lost)
        self.in_flight: dict[str, InFlight] = {}
        #: request id -> (worker, layer) of an adopted batch's request, until it comes back (`claim`)
        self.adopted: dict[str, tuple[str, int]] = {}
        #: the credit in use on every worker, summed, and its batches
        self.held_s = 0.0
        self.held_n = 0
        self._index = CreditIndex()  # the workers with room, roomiest first
        self._open = OpenBubbles()  # when each open bubble is taken as closed, soonest first

    # --- a worker's window and room --------------------------------------------------------

    def window_s(self, c: Credit) -> float:
        """The work `c` may hold: `credit_bubbles` of its typical bubble (at most `max_credit_s`),
        plus the predicted length of a bubble open there now (it runs that much more)."""
        window = min(self.max_credit_s, self.credit_bubbles * c.typical_s())
        return window + (c.bubble.predicted_s if c.bubble is not None else 0.0)

    def room_s(self, c: Credit) -> float:
        """Credit `c` has to spare: its window less the work it holds."""
        return self.window_s(c) - c.held_s

    def recent(self, c: Credit, now: float) -> bool:
        """Whether `c` had a bubble event (or joined) recently enough to get credit."""
        return now - c.last_seen <= self.stage_window_s

    def running(self, worker: str) -> bool:
        """Whether `worker` is in an open bubble now (what it holds may be running)."""
        c = self.workers.get(worker)
        return c is not None and c.bubble is not None

    # --- the workers' records --------------------------------------------------------------

    def seen(self, worker: str, address: str, dc: str, free_memory: int, now: float) -> Credit:
        """The worker's record, refreshed from one of its events."""
        c = self.workers.get(worker)
        if c is None:
            c = self.workers[worker] = Credit(worker)
        c.address, c.free_memory, c.last_seen = address, free_memory, now
        c.dc = dc or c.dc
        return c

    def record(self, worker: str) -> Credit:
        """The worker's record, a blank one if it has none yet."""
        return self.workers.setdefault(worker, Credit(worker))

    def opened(self, c: Credit, bubble: Bubble) -> None:
        """A bubble opened on `c`: its window grows by the bubble's predicted length."""
        c.bubble = bubble
        self._open.opened(c.worker, bubble, bubble.predicted_s or c.typical_s(), self.stage_window_s)
        self.reindex(c)

    def ended(self, c: Credit, actual_s: float | None, finished: tuple[str, ...], now: float) -> None:
        """A bubble of `c` ended (closed by the caller, who tells admission first): its length
        joins `c`'s typical bubble, and the batches that finished in it give their credit back."""
        if actual_s is not None:
            c.lengths.append(actual_s)
        for batch_id in finished:
            self.release(c, batch_id)
        c.last_seen = now
        self.reindex(c)

    def joined(self, c: Credit, typical_s: float) -> None:
        """`c` (re)joined the run: in no bubble, taking prefill, its typical bubble the announced
        one unless it has bubbles on record (a worker rejoining after a recovery)."""
        c.bubble = None  # a bubble of its previous life, whose end never came
        c.off = None  # a new process in the slot: its guest starts afresh
        if not c.lengths and typical_s > 0:
            c.lengths.append(typical_s)
        self.reindex(c)

    def off(self, worker: str, why: str, now: float) -> None:
        """`worker` takes no more prefill: it is offered none until it joins again."""
        c = self.record(worker)
        c.off, c.bubble, c.last_seen = why, None, now
        self.reindex(c)

    def close_stuck(self, now: float) -> list[Ignored]:
        """Close the bubbles open far past their expected length (`OpenBubbles.close_stuck`)."""
        return self._open.close_stuck(now, self.workers, self.reindex)

    # --- the index -------------------------------------------------------------------------

    def reindex(self, c: Credit) -> None:
        """`c`'s room may have changed: its place in the index follows."""
        if c.off is not None:  # takes no prefill: never offered any
            self._index.discard(c.worker)
            return
        self._index.update(c.worker, self.room_s(c))

    def rebuild_index(self) -> None:
        """Every worker back in the index by its room (time went back: a worker left out for not
        having had a bubble recently may be recent again)."""
        self._index.clear()
        for c in self.workers.values():
            self.reindex(c)

    def first(self, skipped: int) -> Credit | None:
        """The roomiest worker after the `skipped` roomiest (`CreditIndex.first`)."""
        worker = self._index.first(skipped)
        return self.workers[worker] if worker is not None else None

    def leave_out(self, c: Credit) -> None:
        """`c` is offered nothing until its room is reindexed (its next event)."""
        self._index.discard(c.worker)

    # --- what is held ----------------------------------------------------------------------

    def hold(self, c: Credit, batch_id: str, ids: tuple[str, ...], seconds: float, kv_bytes: int, now: float) -> None:
        """`c` holds the batch from `now`: its credit in use, the batch in flight. The worker may
        keep it queued up to `hold_s` before a bubble takes it, behind what it holds, then run it;
        its report is due a grace after that (issue 62: without the work ahead of it a live worker
        with a long queue was written off)."""
        ahead_s = c.held_s  # the work it holds already: its queue runs in arrival order
        c.hold(batch_id, seconds, kv_bytes)
        self.held_n += 1
        self.held_s += seconds
        report_by = now + self.hold_s + ahead_s + seconds + self.batch_grace_s
        self.in_flight[batch_id] = InFlight(c.worker, ids, report_by)
        self.reindex(c)

    def release(self, c: Credit, batch_id: str) -> None:
        """The batch is used (or gone): its credit is `c`'s to spare again. The caller reindexes."""
        got = c.held.get(batch_id)
        if got is None:
            return
        c.release(batch_id)
        self.held_n -= 1
        self.held_s = max(0.0, self.held_s - got[0]) if self.held_n else 0.0  # no float drift left

    def reported(self, batch_id: str, worker: str) -> bool:
        """A report of `batch_id` from `worker` came: the batch is no longer in flight, and its
        credit comes back. False: it was not in flight (a previous dispatcher's, or lost)."""
        flight = self.in_flight.pop(batch_id, None)
        if flight is None:
            return False
        self._unadopt(flight)  # an adopted batch's, reported before its requests came back: they queue
        c = self.workers.get(worker)
        if c is not None:
            self.release(c, batch_id)
            self.reindex(c)
        return True

    def overdue(self, now: float) -> Iterator[tuple[str, InFlight]]:
        """The batches whose report is overdue at `now`. Safe to change the book meanwhile: one
        dropped after the walk began (its worker lost) is skipped."""
        for batch_id, b in list(self.in_flight.items()):
            if batch_id in self.in_flight and b.report_by < now:
                yield batch_id, b

    def late_but_alive(self, b: InFlight, now: float) -> float | None:
        """A late batch whose worker was heard from within the grace waits once more: its report
        is due again later, and the time since its worker was heard is returned. None: lost."""
        c = self.workers.get(b.worker)
        if b.extended or c is None or now - c.last_seen > self.batch_grace_s:
            return None
        b.extended, b.report_by = True, now + self.hold_s + c.held_s + self.batch_grace_s
        return now - c.last_seen

    def lost(self, worker: str) -> list[tuple[str, InFlight]]:
        """`worker` is presumed dead: every batch it holds is out of flight (returned), its credit
        is back, its bubble and its typical bubble are forgotten, and it is offered nothing until
        its next bubble event."""
        gone = [(batch_id, b) for batch_id, b in self.in_flight.items() if b.worker == worker]
        for batch_id, b in gone:
            del self.in_flight[batch_id]
            self._unadopt(b)  # an adopted batch's requests not come back yet: they queue when they do
        c = self.workers.get(worker)
        if c is not None:
            for batch_id in list(c.held):
                self.release(c, batch_id)
            c.bubble = None
            c.lengths.clear()
            self._index.discard(worker)
        return gone

    # --- taking over -----------------------------------------------------------------------

    def adopt(self, b: Adopted, now: float) -> bool:
        """A batch an earlier dispatcher of the run sent, that its worker still holds: held and in
        flight as if sent now, its requests noted as held there until they come back (`claim`).
        False if it is in flight already."""
        if b.batch_id in self.in_flight:
            return False
        c = self.record(b.worker)
        c.address = c.address or b.address
        seconds = sum(s for _, _, s in b.items)
        self.hold(c, b.batch_id, tuple(rid for rid, _, _ in b.items), seconds, b.kv_bytes, now)
        for rid, layer, _ in b.items:
            self.adopted[rid] = (b.worker, layer)
        return True

    def claim(self, request_id: str) -> tuple[str, int] | None:
        """The (worker, layer) of an adopted batch that holds this request, which came back now."""
        return self.adopted.pop(request_id, None)

    def _unadopt(self, b: InFlight) -> None:
        for rid in b.ids:
            self.adopted.pop(rid, None)
