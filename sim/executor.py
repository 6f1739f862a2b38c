"""A worker's fill executor on the virtual clock: keeps its `FillQueue`, as services/stage_worker/fill/executor.py does.

* A batch that arrives joins the worker's queue (its credit), bubble or not.
* From a bubble's start the queue runs in arrival order, one block (one layer of one request, or one
  piece of a layer with `piece_tokens`: the pieces the live worker runs, `PrefillProfile.pieces`)
  at a time, each counting for its profiled time (`PrefillProfile.block_s`, with the host's launch
  floor), and a finished request for the profile's `sync_s` more (its first token read). A block
  starts only while the input has not arrived and only if it fits what is left of the bubble by
  its prediction (`fill.may_start`, the fit rule the live worker obeys): the first that does not
  fit ends the bubble's prefill, its rest left empty (`refused_s`).
* When the input arrives the block already running completes (a GPU kernel is not cut short):
  training resumes at that block's end, which is how BubbleTea can slow training. The batch it cut
  stays at the head of the queue with its progress and continues in the next bubble.
* A batch that ran to its end is reported (reached layer, seconds, the layer each item started
  from); the bubble it finished in names it at its end. A request is answered when its own
  blocks and first-token read end, as the live worker answers it, not when its run ends.
* An item the run comes to too late to finish by when its prompt is due (`fill.late_on_worker`) is failed there,
  not run, as the live worker fails it (a `deadline` failure, not an answer past its objective);
  so is one cut by an earlier bubble's end whose rest (`fill.left_s`) can no longer finish by then.
  One it comes to, not started, once the dispatcher may have moved its prompt to the decoder
  (`fill.moved_on_worker`) is left unrun and reported not started, as the live worker leaves it.
* A batch no bubble took within the hold time goes back, reporting how far it got (its partial
  state saved in this datacenter).
* A resumed item starts from its saved layer only in the datacenter that saved it, else from its
  prompt (`resume_layer`), as the live worker does; `saved_in` (shared by every executor) says
  which DC saved the state each request resumes from.

Blocks are not one event each: a run's blocks are laid out when it starts, one event marks its
end, and an input that arrives meanwhile cuts the run at the next block boundary. The decisions are
those of asking block by block.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Protocol

from shared.policies.decisions import Batch
from shared.policies.dispatch_inputs import Progress
from shared.policies.events import EventQueue
from shared.policies.fill import (
    BLOCK_MARGIN,
    OVERRUN_GRACE_S,
    FillQueue,
    blocks_that_fit,
    late_on_worker,
    left_s,
    moved_on_worker,
    resume_layer,
)
from shared.policies.prefill_cost import PrefillProfile


@dataclass(frozen=True, slots=True)
class SimRequest:
    """What the simulator attaches to a request (the dispatch policy passes it through as payload)."""

    id: str
    tokens: int
    arrival: float
    dc: str = ""  # the datacenter the front door routed it to (per-DC dispatch); "" with one dispatcher


class Host(Protocol):
    """Where the executor's reports and answers go (`sim.serving.Serving`)."""

    def report(self, worker: int, batch: Batch[SimRequest], progress: list[Progress], now: float) -> None: ...

    def answered(self, requests: list[SimRequest], now: float) -> None: ...

    def late(self, requests: list[SimRequest], now: float) -> None: ...

    def prefill_span(self, worker: int, start: float, end: float, worked_s: float) -> None:
        """A run of prefill from `start` to `end`, `worked_s` of it computing prompt tokens."""
        ...


@dataclass(slots=True)
class _Progress:
    """How far a batch on the queue got: the item it is at, that item's layer, and per item the
    layer it started from here and its seconds so far."""

    batch: Batch[SimRequest]
    item: int = 0
    layer: int = -1  # -1: the item has not started
    piece: int = 0  # pieces of `layer` done (in memory: a snapshot keeps whole layers only)
    started: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)  # failed here: reached past their due
    answered_at: dict[str, float] = field(default_factory=dict)  # when each finished one was answered
    unrun: set[str] = field(default_factory=set)  # left unrun: their prompts may have moved to the decoder


@dataclass(slots=True)
class _Part:
    """One item's blocks in the running run: `blocks` blocks from `start`, from piece `piece` of
    `layer`, a layer being `pieces` (each block's time, in order; one: a whole layer), and `sync_s`
    after the last if they finish the item."""

    index: int
    layer: int
    piece: int
    pieces: tuple[float, ...]
    start: float
    blocks: int
    sync_s: float
    #: of each block's time, the part that computed prompt tokens (its fixed part apart)
    work: tuple[float, ...] = ()
    late: bool = False  # come to past its due: failed, nothing run
    unrun: bool = False  # come to, not started, once it may have moved: left, nothing run
    #: the time of a layer's first i pieces, i = 0..len(pieces); and of their work
    offsets: tuple[float, ...] = ()
    work_offsets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        self.offsets, self.work_offsets = _running_sums(self.pieces), _running_sums(self.work)

    @property
    def per(self) -> int:
        return len(self.pieces)

    @property
    def end(self) -> float:
        return self.start + self.elapsed(self.blocks) + self.sync_s

    def elapsed(self, k: int) -> float:
        """The time of this part's first `k` blocks."""
        return self._over(self.offsets, k)

    def worked(self, k: int) -> float:
        """The time of this part's first `k` blocks that computed prompt tokens."""
        return self._over(self.work_offsets, k)

    def _over(self, offsets: tuple[float, ...], k: int) -> float:
        if len(offsets) < 2:
            return 0.0
        per, a = len(offsets) - 1, self.piece + k
        return (a // per) * offsets[-1] + offsets[a % per] - offsets[self.piece]

    def started_before(self, at: float) -> int:
        """How many of its blocks started before `at` (each runs to its end)."""
        if not self.pieces or at <= self.start:
            return 0
        per, offsets = self.per, self.offsets
        layer_s = offsets[-1]
        x = at - self.start + offsets[self.piece]
        full = math.floor(x / layer_s)
        rest = x - full * layer_s
        j = bisect_left(offsets, rest - 1e-9 * self.pieces[0], 0, per)
        return max(0, min(self.blocks, full * per + j - self.piece))

    def fitting(self, ends_at: float | None) -> int:
        """How many of its blocks the fit rule starts before the first it refuses (`fill.may_start`),
        in a bubble predicted to end at `ends_at` (None: no prediction)."""
        longest = max(self.pieces, default=0.0) * BLOCK_MARGIN  # the most may_start predicts for one
        if ends_at is None or not self.blocks or longest <= OVERRUN_GRACE_S:
            return self.blocks
        k = self.started_before(ends_at - longest)  # these fit for sure: they start early enough
        rest = (self.pieces[(self.piece + i) % self.per] for i in range(k, self.blocks))
        return k + blocks_that_fit(self.start + self.elapsed(k), ends_at, rest)

    def cut(self, blocks: int) -> None:
        """Only the first `blocks` ran: the item did not finish here."""
        self.blocks, self.sync_s = blocks, 0.0


def _running_sums(values: tuple[float, ...]) -> tuple[float, ...]:
    acc, out = 0.0, [0.0]
    for v in values:
        acc += v
        out.append(acc)
    return tuple(out)


class Executor:
    def __init__(
        self,
        worker: int,
        layers: int,
        queue: FillQueue,
        profile: PrefillProfile,
        events: EventQueue,
        host: Host,
        dc: str = "",
        saved_in: dict[str, str] | None = None,
    ) -> None:
        self.worker, self.layers, self.queue, self.profile = worker, layers, queue, profile
        self.q, self.host = events, host
        self.dc = dc  # this worker's datacenter
        self.saved_in = {} if saved_in is None else saved_in  # request id -> DC of its saved state
        self.progress: dict[str, _Progress] = {}
        self._running: _Progress | None = None
        self._parts: list[_Part] = []
        self._started = 0.0
        self._version = 0  # invalidates the end event of a run cut short
        self._ends_at: float | None = None  # the open bubble's predicted end (None: no prediction)
        #: when, in the open bubble, the fit rule refused a block (its rest stays empty)
        self.full_at: float | None = None
        self.ran_in_bubble = False  # whether a block ran in the open (or last) bubble

    # --- batches from the dispatcher -------------------------------------------------------

    def on_batch(self, now: float, batch: Batch[SimRequest]) -> None:
        self.queue.arrive(batch.batch_id, batch.predicted_s, now)
        self.progress[batch.batch_id] = _Progress(batch)
        self.q.at(now + self.queue.hold_s, self._expire)
        if self._running is None:
            self._next(now)

    def _expire(self, now: float, _: object = None) -> None:
        for batch_id in self.queue.expired(now):
            self._hand_back(self.progress.pop(batch_id), now)

    # --- the bubble (called by training) ---------------------------------------------------

    def open(self, now: float, room_s: float | None = None) -> None:
        """A bubble opened at `now`, taken to last `room_s` by the fit rule (None: nothing known,
        only the input stops prefill; `BubblePredictor.room`)."""
        self.queue.open()
        self._ends_at = None if room_s is None else now + room_s
        self.full_at, self.ran_in_bubble = None, False
        self._next(now)

    def input_arrived(self, now: float) -> float:
        """The awaited input is here: the run stops at the next block boundary. Returns that moment."""
        if self._running is None:
            return now
        cut = now
        for i, part in enumerate(self._parts):
            if now < part.end:
                done = part.started_before(now)
                if done < part.blocks:  # else in its first token's read: the item finishes
                    part.cut(done)
                cut = part.end
                del self._parts[i + 1 :]
                break
        self._version += 1  # the planned end will not come
        return max(cut, now)

    def close(self, now: float) -> tuple[str, ...]:
        """Training resumes: the (cut) run stops; the batches that finished in this bubble."""
        if self._running is not None:
            self._stop(now)
        finished = self.queue.close()
        self._expire(now)
        return finished

    # --- running ---------------------------------------------------------------------------

    def refused_s(self, input_at: float) -> float:
        """The open bubble's rest the fit rule left empty, its input having arrived at `input_at`."""
        return max(0.0, input_at - self.full_at) if self.full_at is not None else 0.0

    def _next(self, now: float) -> None:
        head = self.queue.head()
        if head is None or self.full_at is not None:  # nothing to run, or nothing more fits
            return
        p = self.progress[head.batch_id]
        t, parts = now, []
        for index in range(p.item, len(p.batch.items)):
            item = p.batch.items[index]
            piece = 0
            begun = index == p.item and p.layer >= 0  # cut part way in an earlier run
            if begun:
                layer, piece = p.layer, p.piece
            else:
                layer = resume_layer(item.from_layer, self.saved_in.get(item.id, ""), self.dc)
            if not begun and moved_on_worker(item.moves_from, now):
                parts.append(_Part(index, layer, piece, (), t, 0, 0.0, unrun=True))
                continue
            need = left_s(item.seconds, item.from_layer, item.to_layer, layer) if begun else item.seconds
            if late_on_worker(item.due, t, need):  # as it begins, or resumes after a cut
                parts.append(_Part(index, layer, piece, (), t, 0, 0.0, late=True))
                continue
            pieces, work = self._pieces(item.payload.tokens)  # a SimRequest
            blocks = (item.to_layer - layer) * len(pieces) - piece
            part = _Part(index, layer, piece, pieces, t, blocks, self.profile.sync_s, work)
            parts.append(part)
            if (fit := part.fitting(self._ends_at)) < part.blocks:  # the rest of the bubble stays empty
                part.cut(fit)
                self.full_at = part.end
                t = part.end
                break
            t = part.end
        self._running, self._parts, self._started = p, parts, now
        self._version += 1
        self.q.at(t, self._planned_end, self._version)

    def _pieces(self, tokens: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The time of each block of one layer of a `tokens`-token prompt (one: a whole layer), and
        of each the part that computes its tokens (`PrefillProfile.token_s`)."""
        sizes = self.profile.pieces(tokens)
        return tuple(self.profile.block_s(n) for n in sizes), tuple(self.profile.token_s(n) for n in sizes)

    def _planned_end(self, now: float, version: int) -> None:
        if version != self._version or self._running is None:
            return
        self._stop(now)
        self._next(now)

    def _stop(self, now: float) -> None:
        """The running run ends (all its blocks done, or cut): record how far its batch got, answer
        what it finished (each when it finished), and report the batch if it is done."""
        p, parts = self._running, self._parts
        assert p is not None
        self._running, self._parts = None, []
        answered, late, ran, worked = [], [], 0, 0.0
        for part in parts:
            item = p.batch.items[part.index]
            if part.unrun:
                p.unrun.add(item.id)
                p.item, p.layer, p.piece = part.index + 1, -1, 0
                continue
            if part.late:
                self.saved_in.pop(item.id, None)
                late.append(item.payload)
                p.late.add(item.id)
                p.answered_at[item.id] = part.start
                p.item, p.layer, p.piece = part.index + 1, -1, 0
                continue
            p.started.setdefault(item.id, part.layer)
            p.seconds[item.id] = p.seconds.get(item.id, 0.0) + part.end - part.start
            ran += part.blocks
            worked += part.worked(part.blocks)
            pieces = part.piece + part.blocks
            reached = part.layer + pieces // part.per
            p.item, p.layer, p.piece = part.index, reached, pieces % part.per
            if reached >= item.to_layer:
                self.saved_in.pop(item.id, None)
                answered.append((item.payload, part.end))
                p.answered_at[item.id] = part.end
                p.item, p.layer, p.piece = part.index + 1, -1, 0
            else:
                break
        if ran:
            self.ran_in_bubble = self.ran_in_bubble or self.queue.in_bubble
            self.host.prefill_span(self.worker, self._started, now, worked)
        for payload, done in answered:
            self.host.answered([payload], done)
        if late:
            self.host.late(late, now)
        if p.item >= len(p.batch.items):
            self.queue.ran(p.batch.batch_id, finished=True)
            del self.progress[p.batch.batch_id]
            self.host.report(self.worker, p.batch, self._report(p), now)
        else:
            left = sum(i.seconds for i in p.batch.items[p.item :])
            self.queue.ran(p.batch.batch_id, finished=False, left_s=left)

    def _report(self, p: _Progress) -> list[Progress]:
        """Every item of `p`'s batch: done, reached (its state saved here), or not started."""
        out = []
        for index, item in enumerate(p.batch.items):
            started, secs = p.started.get(item.id), p.seconds.get(item.id, 0.0)
            if item.id in p.late:  # failed, nothing run: finished where it was
                out.append(Progress(item.id, item.from_layer, 0.0, True, None, p.answered_at.get(item.id)))
            elif item.id in p.unrun:  # not started: the dispatcher moves it (or has)
                out.append(Progress(item.id, item.from_layer, 0.0, False, None))
            elif index < p.item:
                out.append(Progress(item.id, item.to_layer, secs, True, started, p.answered_at.get(item.id)))
            elif index == p.item and p.layer >= 0:  # cut part way (below its from_layer if computed again)
                if p.layer > item.from_layer:
                    self.saved_in[item.id] = self.dc  # where the next run resumes it from
                out.append(Progress(item.id, p.layer, secs, False, started))
            else:
                out.append(Progress(item.id, item.from_layer, secs, False, started))
        return out

    def _hand_back(self, p: _Progress, now: float) -> None:
        self.host.report(self.worker, p.batch, self._report(p), now)
