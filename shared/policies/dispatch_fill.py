"""What goes where: the half of the dispatch policy that packs waiting requests into open bubbles
and stages work for idle workers' next bubbles (`shared.policies.dispatch`'s module docstring has
the rules), and the room indexes it keeps. `Filling` is mixed into `DispatchState`, whose tables
it reads and writes; it holds no state of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from shared.policies.decisions import Batch, BatchItem, Decisions, Trigger, Why
from shared.policies.dispatch_index import BubbleKey, Head, RoomIndex, add_sorted, discard_sorted
from shared.policies.dispatch_inputs import Bubble, Counts, InFlight, Request
from shared.policies.packing import Assignment, Candidate, WaitingQueue, budget, layered_cost, pack_ordered
from shared.policies.prefill_cost import PrefillCostModel


class Filling:
    """Packing and staging, over `DispatchState`'s tables (declared here for the type checker)."""

    layers: int
    guard_s: float
    overhead_s: float
    max_batch: int
    cost: PrefillCostModel
    stage_next: bool
    stage_s: float
    hold_s: float
    ahead_s: float
    batch_prefix: str
    stage_window_s: float
    batch_grace_s: float
    requests: dict[str, Request]
    bubbles: dict[str, Bubble]
    staged: dict[str, tuple[float, int]]
    recent: dict[str, deque[float]]
    free_memory: dict[str, int]
    last_seen: dict[str, float]
    addresses: dict[str, str]
    in_flight: dict[str, InFlight]
    counts: Counts
    _waiting: int
    _queue: WaitingQueue
    _bubble_key: dict[str, BubbleKey]
    _room: RoomIndex
    _idle: list[str]
    _clock: float

    def _dequeued(self, req: Request) -> None:  # DispatchState's queue accounting
        raise NotImplementedError

    def _fill_all(self, now: float, trigger: Trigger) -> Decisions:
        """Top up every open bubble, oldest first, then stage work for idle workers' next bubbles,
        until nothing waits. Visits only the indexed bubbles and workers: the others would take
        nothing (the same decisions as visiting all of them)."""
        out = Decisions()
        if not self._waiting:  # nothing to pack
            return out
        if now < self._clock:  # time went back: what was dropped for lack of time may have some
            self._reindex()
        self._clock = now
        head = self._head(now)
        if head is None:  # every waiting request has expired: nothing is packed anywhere
            return out
        self._room.release(head)
        key = self._room.first()
        while key is not None:
            b = self.bubbles[key[2]]
            left, memory = self._left(b, now), b.free_memory - b.sent_bytes
            if left <= 0:  # and stays so until a report gives some back (`_give_back`)
                self._room.remove(key)
            elif head.blocks(left, memory):  # and so for any head that needs as much
                self._room.set_aside(key, left, memory)
            else:
                d = self._fill_bubble(b, left, now, trigger)
                if d:
                    out += d
                    head = self._head(now)
                    if head is None:  # nothing left to pack
                        return out
                    self._room.release(head)  # those it frees that come before `key` wait for the next pass
            key = self._room.after(key)
        for worker in list(self._idle):
            room = self._stage_room(worker, now)
            if room is None:  # and stays so until its bubble ends or its staged work comes back
                discard_sorted(self._idle, worker)
                continue
            if head.blocks(room[1], self.free_memory.get(worker, 0)):
                continue
            d = self._stage_batch(worker, *room, now, trigger)
            if d:
                out += d
                head = self._head(now)
                if head is None:
                    return out
        return out

    def _head(self, now: float) -> Head | None:
        """The first waiting request that packing would consider now (none: nothing waits, or all
        that waits has expired)."""
        if not self._waiting:
            return None
        for c in self._candidates():
            if c.deadline is None or c.deadline >= now:
                cost = layered_cost(self.cost.predict, self.layers)
                return Head(
                    c.kv_bytes,
                    cost(c.tokens, c.next_layer, self.layers),
                    cost(c.tokens, c.next_layer, c.next_layer + 1),
                )
        return None

    def _fill(self, worker: str, now: float, trigger: Trigger) -> Decisions:
        b = self.bubbles.get(worker)
        if b is None:
            return Decisions()
        return self._fill_bubble(b, self._left(b, now), now, trigger)

    def _left(self, b: Bubble, now: float) -> float:
        """Seconds of work `b` still takes (never more as time passes, less as work is sent)."""
        return max(budget(b.predicted_s, now - b.started, self.guard_s, self.overhead_s), self.ahead_s) - b.sent_s

    def _fill_bubble(self, b: Bubble, left: float, now: float, trigger: Trigger) -> Decisions:
        plan, queued = self._pack(left, b.free_memory - b.sent_bytes, now)
        if not plan:
            return Decisions()
        why = Why(trigger, b.tag, b.predicted_s, left, sum(a.seconds for a in plan), queued)
        batch, kv_bytes = self._send(b.worker, plan, hold=False, why=why, now=now)
        b.sent_s += batch.predicted_s
        b.sent_bytes += kv_bytes
        return Decisions(batches=(batch,))

    def _stage(self, worker: str, now: float, trigger: Trigger) -> Decisions:
        """The first batch of `worker`'s next bubble, sent now and held there until it starts
        (none if staging is off, something is staged already, or nothing fits)."""
        room = self._stage_room(worker, now)
        return Decisions() if room is None else self._stage_batch(worker, *room, now, trigger)

    def _stage_room(self, worker: str, now: float) -> tuple[float, float] | None:
        """(typical bubble, room) for work staged on `worker` now; None if it may take none."""
        recent = self.recent.get(worker)
        if not self.stage_next or worker in self.staged or not recent or worker in self.bubbles:
            return None
        if now - self.last_seen.get(worker, -1e18) > self.stage_window_s:
            return None
        typical = sorted(recent)[len(recent) // 2]
        room = max(0.0, min(self.stage_s, typical - self.guard_s - self.overhead_s))
        return (typical, room) if room > 0 else None

    def _stage_batch(self, worker: str, typical: float, room: float, now: float, trigger: Trigger) -> Decisions:
        plan, queued = self._pack(room, self.free_memory.get(worker, 0), now)
        if not plan:
            return Decisions()
        why = Why(trigger, None, typical, room, sum(a.seconds for a in plan), queued)
        batch, kv_bytes = self._send(worker, plan, hold=True, why=why, now=now)
        self.staged[worker] = (batch.predicted_s, kv_bytes)
        return Decisions(batches=(batch,))

    def _pack(self, left: float, free_memory: int, now: float) -> tuple[tuple[Assignment, ...], int]:
        """The plan for `left` seconds and `free_memory` bytes, and how many requests waited."""
        if left <= 0 or not self._waiting:
            return (), self._waiting  # no room, or nothing to put there: no pass over the requests
        plan = pack_ordered(
            self._candidates(),
            budget_s=left,
            free_memory=free_memory,
            layers=self.layers,
            cost=layered_cost(self.cost.predict, self.layers),
            now=now,
            max_requests=self.max_batch,
        )
        return plan.assignments, self._waiting

    def _candidates(self) -> Iterator[Candidate]:
        """The waiting requests in packing order, read lazily (packing stops at the plan's end)."""
        for rid in self._queue:
            r = self.requests[rid]
            yield Candidate(r.id, r.tokens, r.next_layer, r.arrival, r.kv_bytes, r.deadline)

    def _send(
        self, worker: str, plan: tuple[Assignment, ...], *, hold: bool, why: Why, now: float
    ) -> tuple[Batch, int]:
        """The batch of `plan` for `worker`, its requests marked there and it put in flight; with
        the KV bytes its requests will hold on the worker."""
        items, kv_bytes = [], 0
        for a in plan:
            r = self.requests[a.id]
            r.in_bubble, r.assigned_s = worker, a.seconds
            self._queue.take(a.id)
            self._dequeued(r)
            items.append(BatchItem(a.id, r.payload, a.from_layer, a.to_layer, a.seconds))
            kv_bytes += r.kv_bytes
        self.counts.batches += 1
        batch_id = f"{self.batch_prefix}-{self.counts.batches}"
        batch = Batch(batch_id, worker, self.addresses[worker], tuple(items), hold, why)
        # A staged batch may wait on its worker for the next bubble to start.
        report_by = now + batch.predicted_s + self.batch_grace_s + (self.hold_s if hold else 0.0)
        self.in_flight[batch.batch_id] = InFlight(worker, tuple(a.id for a in plan), report_by)
        return batch, kv_bytes

    def _give_back(self, worker: str, req: Request) -> None:
        """A request left `worker` (reported or requeued): its share no longer counts there."""
        b = self.bubbles.get(worker)
        if b is not None:
            b.sent_s = max(0.0, b.sent_s - req.assigned_s)
            b.sent_bytes = max(0, b.sent_bytes - req.kv_bytes)
            self._room.add(self._bubble_key[worker])  # it may have room again
        elif worker in self.staged:
            secs, nbytes = self.staged[worker]
            left_s, left_b = max(0.0, secs - req.assigned_s), max(0, nbytes - req.kv_bytes)
            if left_s <= 0 and left_b <= 0:
                del self.staged[worker]
                add_sorted(self._idle, worker)  # it may take staged work again
            else:
                self.staged[worker] = (left_s, left_b)
        req.assigned_s = 0.0

    def _close(self, worker: str) -> None:
        del self.bubbles[worker]
        self._room.remove(self._bubble_key.pop(worker))

    def _reindex(self) -> None:
        """Every open bubble and every worker with recent bubbles back in the indexes."""
        self._room = RoomIndex(self._bubble_key.values())
        self._idle = sorted(self.recent)
