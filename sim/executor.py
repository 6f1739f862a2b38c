"""A worker's fill executor on the virtual clock: obeys `FillPolicy`, as services/stage_worker/filler.py does.

* A batch arriving in an open bubble runs there; a staged one (`hold`) waits for the next bubble and
  goes back unrun if none takes it within the policy's hold time; any other goes straight back.
* Batches run in arrival order, one block (one layer of one request) at a time, each counting for
  its profiled time (`PrefillProfile.block_s`). A block starts only if the policy allows it: the
  training input has not arrived and the block ends before the bubble's predicted end minus the
  guard. Once a block no longer fits, the executor takes no more batches and waits for the input.
* When the input arrives the block already running completes (a GPU kernel is not cut short):
  training resumes at that block's end, which is how BubbleTea can slow training.
* Every batch ends in one report to the dispatcher (reached layer and seconds per item; items not
  run report their start layer); finished requests are answered when their batch ends.
* A resumed item starts from its saved layer only in the datacenter that saved it, else from its
  prompt (`resume_layer`), as the live worker does; `saved_in` (shared by every executor) says
  which DC saved the state each request resumes from.

Blocks are not one event each: a batch's blocks are laid out when it starts (the policy is asked
where the run must stop for time), one event marks its end, and an input that arrives meanwhile
cuts the run at the next block boundary. The decisions are those of asking block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from shared.policies.decisions import Batch, BatchItem
from shared.policies.dispatch import Progress
from shared.policies.events import EventQueue
from shared.policies.fill import Arrival, FillPolicy, Held, resume_layer
from shared.policies.prefill_cost import PrefillProfile


@dataclass(frozen=True, slots=True)
class SimRequest:
    """What the simulator attaches to a request (the dispatch policy passes it through as payload)."""

    id: str
    tokens: int
    arrival: float


class Host(Protocol):
    """Where the executor's reports and answers go (`sim.serving.Serving`)."""

    def report(self, worker: int, batch: Batch, progress: list[Progress], now: float) -> None: ...

    def answered(self, requests: list[SimRequest], now: float) -> None: ...

    def prefill_span(self, worker: int, start: float, end: float) -> None: ...


@dataclass(slots=True)
class _Part:
    """One item's share of the running batch: `blocks` blocks of `block_s` from `start`."""

    item: BatchItem
    from_layer: int  # where it starts here (`resume_layer`)
    start: float
    block_s: float
    blocks: int


class Executor:
    def __init__(
        self,
        worker: int,
        layers: int,
        policy: FillPolicy,
        profile: PrefillProfile,
        queue: EventQueue,
        host: Host,
        dc: str = "",
        saved_in: dict[str, str] | None = None,
    ) -> None:
        self.worker, self.layers, self.policy, self.profile = worker, layers, policy, profile
        self.q, self.host = queue, host
        self.dc = dc  # this worker's datacenter
        self.saved_in = {} if saved_in is None else saved_in  # request id -> DC of its saved state
        self.queued: list[tuple[Batch, Held]] = []
        self.in_bubble = False
        self.ends_at = 0.0  # no block may end after this (the bubble's predicted end minus the guard)
        self.out_of_time = False  # the next block did not fit: wait for the input, take nothing more
        self._batch: Batch | None = None  # the batch running now
        self._parts: list[_Part] = []
        self._started = 0.0
        self._version = 0  # invalidates the end event of a run cut short

    # --- batches from the dispatcher -------------------------------------------------------

    def on_batch(self, now: float, batch: Batch) -> None:
        action = self.policy.on_arrival(staged=batch.hold, in_bubble=self.in_bubble)
        if action is Arrival.RETURN:  # its bubble closed before it got here
            self._hand_back([batch], now)
            return
        self.queued.append((batch, Held(batch.batch_id, batch.hold, now)))
        if action is Arrival.HOLD:
            self.q.at(now + self.policy.hold_s, self._expire_holds)
        elif self._batch is None and not self.out_of_time:
            self._next(now)

    def _expire_holds(self, now: float, _: object = None) -> None:
        gone = set(self.policy.expired_holds([h for _, h in self.queued], in_bubble=self.in_bubble, now=now))
        if gone:
            self._hand_back(self._take(gone), now)

    # --- the bubble (called by training) ---------------------------------------------------

    def open(self, now: float, predicted_s: float) -> None:
        if not self.policy.worth_filling(predicted_s):
            return  # not in a bubble as far as batches go: sent ones go back, staged ones wait
        self.in_bubble, self.out_of_time = True, False
        self.ends_at = self.policy.fill_until(now, predicted_s)
        self._next(now)

    def input_arrived(self, now: float) -> float:
        """The awaited input is here: the run stops at the next block boundary. Returns that moment."""
        if self._batch is None:
            return now
        cut = now
        for i, part in enumerate(self._parts):
            end = part.start + part.blocks * part.block_s
            if now < end:
                done = max(0, math.ceil((now - part.start) / part.block_s - 1e-9))
                part.blocks = done
                cut = part.start + done * part.block_s
                del self._parts[i + 1 :]
                break
        self._version += 1  # the planned end will not come
        return max(cut, now)

    def close(self, now: float) -> None:
        """Training resumes: finish the (cut) run, and hand back what was sent for this bubble."""
        if self._batch is not None:
            self._finish(now)
        self.in_bubble = False
        back = set(self.policy.at_bubble_end([h for _, h in self.queued]))
        if back:
            self._hand_back(self._take(back), now)

    # --- running ---------------------------------------------------------------------------

    def _next(self, now: float) -> None:
        i = self.policy.next_batch([h for _, h in self.queued])
        if i is None:
            return
        batch, _ = self.queued.pop(i)
        t, parts = now, []
        for item in batch.items:
            assert isinstance(item.payload, SimRequest)
            block = self.profile.block_s(item.payload.tokens)
            first = resume_layer(item.from_layer, self.saved_in.get(item.id, ""), self.dc)
            need = item.to_layer - first
            n = self.policy.blocks_that_start(start=t, block_s=block, need=need, ends_at=self.ends_at)
            parts.append(_Part(item, first, t, block, n))
            t += n * block
            if n < need:
                self.out_of_time = True
                break
        self._batch, self._parts, self._started = batch, parts, now
        self._version += 1
        self.q.at(t, self._planned_end, self._version)

    def _planned_end(self, now: float, version: int) -> None:
        if version != self._version or self._batch is None:
            return
        self._finish(now)
        if not self.out_of_time:
            self._next(now)

    def _finish(self, now: float) -> None:
        batch, parts = self._batch, self._parts
        assert batch is not None
        self._batch, self._parts = None, []
        progress, answered, ran = [], [], 0
        for part in parts:
            reached = part.from_layer + part.blocks
            finished = reached >= self.layers
            if finished:
                self.saved_in.pop(part.item.id, None)
            elif reached > part.item.from_layer:  # its state is saved here, where the next run resumes from
                self.saved_in[part.item.id] = self.dc
            progress.append(Progress(part.item.id, reached, part.blocks * part.block_s, finished))
            ran += part.blocks
            if finished:
                assert isinstance(part.item.payload, SimRequest)
                answered.append(part.item.payload)
        progress += [Progress(it.id, it.from_layer, 0.0) for it in batch.items[len(parts) :]]
        if ran:
            self.host.prefill_span(self.worker, self._started, now)
        if answered:
            self.host.answered(answered, now)
        self.host.report(self.worker, batch, progress, now)

    def _take(self, ids: set[str]) -> list[Batch]:
        out = [b for b, h in self.queued if h.batch_id in ids]
        self.queued = [(b, h) for b, h in self.queued if h.batch_id not in ids]
        return out

    def _hand_back(self, batches: list[Batch], now: float) -> None:
        for b in batches:
            self.host.report(self.worker, b, [Progress(it.id, it.from_layer, 0.0) for it in b.items], now)
