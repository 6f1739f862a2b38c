"""The fill policy (pure): a worker's queue of prefill work, and what runs when.

Training is the owner, prefill the guest. The worker's fill executor (services/stage_worker/fill/executor.py)
and the simulator's (sim/executor.py) keep their queue in a `FillQueue` and obey it; their threads,
Redis I/O and clocks hold no rule of their own.

* **Work waits on the worker, not the worker on work.** The dispatcher keeps about a bubble and a
  half of predicted prefill queued on every worker (its credit, `shared.policies.dispatch`). A batch
  that arrives joins the queue whether or not a bubble is open; only a batch delivered again (a
  previous process of this slot held it, unacked) goes back unrun.
* **A bubble runs the queue while the next block fits.** From the moment a bubble opens, the
  batches run in arrival order, one block at a time: one layer of one request on a CPU, one piece
  of `piece_tokens` tokens of a layer on a GPU. A block starts only while the awaited input has not
  arrived, and only if its expected time with a margin fits what is left of the bubble by its
  prediction, or is too short to matter (`may_start`, the fit rule: the live worker on every
  device and the simulator obey it alike). The block running when the input comes finishes (a GPU
  kernel is not cut short) and training resumes at its end: BubbleTea's only cost to training, which
  the rule keeps under the grace unless a bubble ends before its prediction. A block that does not
  fit ends the bubble's prefill (FULL); the batch waits at the head for the next bubble.
* **A batch the input interrupted stays at the head**, its progress kept where it is (in memory on
  a live worker), and continues in the worker's next bubble.
* **A bubble's end says what it used**: the batches that finished in it (`close`), so the dispatcher
  tops up the worker's credit at once, before their reports arrive.
* **Nothing waits forever**: a batch still queued `hold_s` after it arrived, outside a bubble
  (training paused, or over), goes back (`expired`), and everything goes back when the worker stops
  (`drain`). A batch that went back is reported with how far it got, so the dispatcher queues the
  rest again.
* A preempted prefill resumes from its saved state only in the datacenter that saved it
  (`resume_layer`); a worker in another DC computes it again from its prompt.

Tested by: tests/unit/test_fill_policy.py, tests/unit/test_prefill_pieces.py, tests/unit/test_sim.py.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.config.spec import BubbleTea

#: A worker keeps a batch this long at most while no bubble takes it (training paused or over),
#: then hands it back and the dispatcher queues its requests again: the spec's default
#: (`bubbletea.hold_ms`), which the device time scale stretches like the gaps between bubbles.
HOLD_STAGED_S = 1.0


class Arrival(enum.StrEnum):
    """What a worker does with a batch that just arrived."""

    QUEUE = "queue"  # into the queue: it runs in this bubble (if one is open) or the next ones
    RETURN = "return"  # delivered again after this slot's previous process died: back, unrun
    DUPLICATE = "duplicate"  # a copy of a batch this worker holds or held: dropped (no report)


@dataclass
class Held:
    """A batch on the worker's queue, as the policy sees it."""

    batch_id: str
    predicted_s: float  # what is left of it, by the dispatcher's prediction
    received: float  # when it arrived on the worker (the executor's clock)
    started: bool = False  # part of it ran: it continues where it stopped


#: `bubbletea.piece_tokens: 0` on a GPU: a layer runs in pieces of this many tokens.
GPU_PIECE_TOKENS = 256


def piece_tokens(setting: int, *, on_gpu: bool) -> int | None:
    """Tokens of one prefill piece within a layer (None: whole layers). `setting` 0 is automatic:
    pieces on a GPU, where a long prompt's layer is milliseconds that a kernel already launched
    cannot give back; whole layers on a CPU, as before (a block there is a fraction of one)."""
    if setting > 0:
        return setting
    return GPU_PIECE_TOKENS if on_gpu else None


def late_on_worker(due: float | None, now: float, predicted_s: float) -> bool:
    """Whether a worker that comes at `now` to an item predicted to take `predicted_s` fails it
    rather than run it: it would finish after its prompt is due (`due`: its objective or deadline;
    None: never), so its answer would be late. The dispatcher fails what it still holds past its
    due; this is the rule for what it sent, which a worker would otherwise answer late."""
    return due is not None and now + predicted_s > due


def left_s(predicted_s: float, from_layer: int, to_layer: int, reached: int) -> float:
    """What is left of an item predicted to take `predicted_s` for its layers [from_layer,
    to_layer) once it has reached layer `reached` (cut by training input, it resumes in a later
    bubble): the share of its layers not run yet. A worker checks a resuming item against its due
    with it (`late_on_worker`), as it checked the item when it began: a bubble's end between the
    two had made 0.6% of the answers of `bench/up_overload.py` late by up to 0.24 s (2026-11-29)."""
    span = to_layer - from_layer
    return predicted_s * max(0, to_layer - reached) / span if span > 0 else 0.0


def moved_on_worker(moved_by: float | None, bubble_started: float) -> bool:
    """Whether a worker leaves an item not started yet unrun in a bubble that opened at
    `bubble_started`: the item waited between bubbles past `moved_by` (None: never), by when the
    dispatcher has moved its prompt to the decoder (its bubble did not come in time:
    `prompt_placement.moves_at`), which computes it; run here too, the bubble's time would go to an
    answer nobody reads. Left unrun, it is reported not started. In a bubble that opened before, the
    dispatcher saw it running and did not move it: it runs."""
    return moved_by is not None and bubble_started >= moved_by


class Start(enum.StrEnum):
    """Whether the next block of prefill starts in the open bubble, and if not, why."""

    GO = "go"
    INPUT = "input"  # training's awaited input is here: training resumes
    FULL = "full"  # it would not fit what is left of the bubble: the bubble's rest stays empty


#: A block is predicted to take this many times its expected time (its time varies: attention over
#: a layer's earlier pieces grows, the device is shared with training, the host is busy).
BLOCK_MARGIN = 1.5
#: What a block may run past a bubble's predicted end: one this short starts whatever the
#: prediction says (were the input to arrive at once, training would wait this long at most).
OVERRUN_GRACE_S = 0.25e-3


def may_start(
    *,
    input_arrived: bool,
    block_s: float | None,
    left_s: float | None,
    margin: float = BLOCK_MARGIN,
    grace_s: float = OVERRUN_GRACE_S,
    busy_s: float = 0.0,
) -> Start:
    """The fit rule: whether the next block may start, on every device and in the simulator. A
    block is one layer of one prompt (a CPU) or one piece of one (a GPU: `piece_tokens`).

    Never once the input is here (INPUT). Otherwise only if its expected time (`block_s`: the
    device profile's, or as measured on this worker; None: not measured yet) with the `margin` fits
    what is left of the bubble by its prediction (`left_s`; None: no prediction) after the work
    still on the device (`busy_s`: blocks launched and not done, predicted; a GPU's host runs one
    block ahead of the device), or is within `grace_s` (a block that short costs training next to
    nothing even past a bubble's predicted end); else FULL. So a block never runs past a bubble's
    predicted end by much more than the grace, while a bubble that outlives its prediction still
    takes short blocks to its end. A bubble shorter than predicted can still be overrun (the
    predictor takes the shortest of the recent ones at its position: rarely)."""
    if input_arrived:
        return Start.INPUT
    if block_s is None or left_s is None:
        return Start.GO
    predicted = block_s * margin
    return Start.GO if predicted <= grace_s or predicted <= left_s - busy_s else Start.FULL


def blocks_that_fit(
    start: float,
    ends_at: float | None,
    durations: Iterable[float],
    margin: float = BLOCK_MARGIN,
    grace_s: float = OVERRUN_GRACE_S,
) -> int:
    """How many of the blocks `durations` (run back to back from `start`) the fit rule starts in a
    bubble predicted to end at `ends_at` (None: no prediction) before the first it refuses: the
    simulator's executor lays a run out with it, asking `may_start` block by block (read lazily:
    it stops at the first refused)."""
    t, started = start, 0
    for d in durations:
        left = None if ends_at is None else ends_at - t
        if may_start(input_arrived=False, block_s=d, left_s=left, margin=margin, grace_s=grace_s) is not Start.GO:
            break
        t, started = t + d, started + 1
    return started


def usable_s(bubble_s: float, block_s: float, margin: float = BLOCK_MARGIN, grace_s: float = OVERRUN_GRACE_S) -> float:
    """The seconds the fit rule can fill of a bubble of `bubble_s` (as predicted) with blocks of
    `block_s` back to back, the queue never empty: the blocks it starts, less any part of the last
    past the bubble's end. The capacity figures count this, not the whole bubble: the rest is what
    the rule refuses (under one block and its margin)."""
    if bubble_s <= 0 or block_s <= 0:
        return max(0.0, bubble_s)
    if block_s * margin <= grace_s:  # every block starts: the bubble fills to its end
        return bubble_s
    room = bubble_s - block_s * margin
    if room < 0:
        return 0.0
    started = math.floor(room / block_s + 1e-9) + 1
    return min(bubble_s, started * block_s)


#: Measurements of a block's time a worker keeps, the most recent (`BlockTimes`).
BLOCK_TIMES_KEPT = 16
#: Without a block measured for this long, a worker predicts a block at the fastest it kept
#: (`BlockTimes`): the prediction it had kept every block out, with nothing to correct it.
BLOCK_TIME_STALE_S = 5.0


@dataclass
class BlockTimes:
    """A block's time as measured on this worker (a layer on a CPU, a piece on a GPU): seconds per
    token of block (a block's time is nearly proportional to its tokens once it is long enough to
    matter, and the device's other work moves it).

    The prediction is the upper quartile of the last `kept` measurements: one block a stall
    slowed (the host descheduled the worker, a collection paused it) moves it by one rank, a device
    slower for a while moves it once a quarter of them are. Measurements come only from blocks the
    prediction let run, so one that refuses every block is never corrected by a measurement: a mean
    of them had, after one block measured 100 times too slow on a loaded machine, refused every
    block for a minute, until the prompt's deadline failed it (CI, 2026-12-06). So, past `stale_s`
    without a measurement, a block is predicted at the fastest kept: a time this worker measured,
    which lets one run if the device can run it that fast in the bubble, and measures it."""

    kept: int = BLOCK_TIMES_KEPT
    stale_s: float = BLOCK_TIME_STALE_S
    _rates: deque[float] = field(default_factory=deque)
    _last: float = -math.inf  # when the last was measured

    def observe(self, tokens: int, seconds: float, now: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        self._rates.append(seconds / tokens)
        while len(self._rates) > self.kept:
            self._rates.popleft()
        self._last = now

    def predict(self, tokens: int, now: float) -> float | None:
        """Seconds for a block of `tokens` tokens at `now`; None until one was measured."""
        if not self._rates:
            return None
        ranked = sorted(self._rates)
        rate = ranked[0] if now - self._last > self.stale_s else ranked[(3 * len(ranked)) // 4]
        return rate * tokens


#: Batch ids a worker remembers, to drop a second copy of one (`FillQueue.delivered`): a copy lands
#: within a write's retries (seconds), and this many batches are minutes of a worker's work.
DELIVERED_KEPT = 4096


@dataclass
class FillQueue:
    """One worker's queue of batches (oldest first) and its bubble, on any clock."""

    hold_s: float = HOLD_STAGED_S
    held: list[Held] = field(default_factory=list)
    in_bubble: bool = False
    #: batches finished in the open bubble (its end reports them)
    _finished: list[str] = field(default_factory=list)
    #: the ids of the batches delivered here, newest last (at most `DELIVERED_KEPT`)
    _delivered: dict[str, None] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, bt: BubbleTea) -> FillQueue:
        """The queue a worker (or the simulator's executor) keeps for the spec's `bubbletea` section."""
        return cls(hold_s=bt.hold_ms / 1000)

    @property
    def queued_s(self) -> float:
        """Predicted seconds of work queued here."""
        return sum(h.predicted_s for h in self.held)

    def ids(self) -> list[str]:
        return [h.batch_id for h in self.held]

    def delivered(self, batch_id: str, *, redelivered: bool = False) -> Arrival:
        """A batch was delivered (before its saved states are read and it `arrive`s): DUPLICATE if a
        batch of that id was delivered here before, held, run or handed back. A batch id is the
        dispatcher's, one per batch it sends, so a second copy is a write it retried (its XADD
        applied twice): dropped, neither run nor reported (the first copy's report, or its loss, is
        what the dispatcher counts). Otherwise RETURN if `redelivered` (see `arrive`), else QUEUE."""
        if batch_id in self._delivered:
            return Arrival.DUPLICATE
        self._delivered[batch_id] = None
        if len(self._delivered) > DELIVERED_KEPT:
            del self._delivered[next(iter(self._delivered))]
        return Arrival.RETURN if redelivered else Arrival.QUEUE

    def arrive(self, batch_id: str, predicted_s: float, now: float, *, redelivered: bool = False) -> Arrival:
        """`redelivered`: delivered before and never acked, so sent to this slot's previous process.
        It goes back unrun: the dispatcher may already have queued it again (running it here would
        only duplicate that work), and if not, its report requeues it at once rather than when it
        is overdue."""
        if redelivered:
            return Arrival.RETURN
        self.held.append(Held(batch_id, predicted_s, now))
        return Arrival.QUEUE

    def open(self) -> None:
        """A bubble opened: the queue runs from its head."""
        self.in_bubble = True
        self._finished = []

    def head(self) -> Held | None:
        """The batch to run now: the oldest, while a bubble is open."""
        return self.held[0] if self.in_bubble and self.held else None

    def ran(self, batch_id: str, *, finished: bool, left_s: float = 0.0) -> None:
        """`batch_id` ran in this bubble: to its end (`finished`: off the queue), or until the input
        came (it stays at the head with `left_s` predicted seconds to go)."""
        i = self._index(batch_id)
        if finished:
            del self.held[i]
            self._finished.append(batch_id)
        else:
            self.held[i].started, self.held[i].predicted_s = True, left_s

    def close(self) -> tuple[str, ...]:
        """The bubble ended: the batches that finished in it (what its `BubbleEnd` says it used)."""
        self.in_bubble = False
        done, self._finished = tuple(self._finished), []
        return done

    def expired(self, now: float) -> list[str]:
        """Off the queue, to go back: the batches that arrived `hold_s` or more before `now`, none
        while a bubble is open (it runs them)."""
        if self.in_bubble:
            return []
        gone = [h.batch_id for h in self.held if now - h.received >= self.hold_s]
        if gone:
            self.held = [h for h in self.held if h.batch_id not in gone]
        return gone

    def drain(self) -> list[str]:
        """Off the queue, to go back: everything (the worker stops; nothing more runs here)."""
        gone, self.held = [h.batch_id for h in self.held], []
        return gone

    def _index(self, batch_id: str) -> int:
        for i, h in enumerate(self.held):
            if h.batch_id == batch_id:
                return i
        raise KeyError(f"batch {batch_id} is not queued here")


def resumes_from_saved_state(saved_in: str, here: str) -> bool:
    """Whether a worker in datacenter `here` resumes a prefill from the state a worker in
    `saved_in` saved: only in the same datacenter.

    Why not fetch the state across: a snapshot (hidden state and KV so far, up to a KV cache's
    size) would cross the WAN the pipeline's activations need, and take its time from training
    (measured under the kernel WAN: the demo's training slowed 295%). A bubble's compute is
    what is spare, so the request is computed again from its prompt instead."""
    return saved_in == here


def resume_layer(from_layer: int, saved_in: str, here: str) -> int:
    """The layer a resumed prefill starts from on a worker in datacenter `here`, its state having
    been saved at `from_layer` in `saved_in`: that layer, or 0 (its prompt) in another datacenter."""
    return from_layer if resumes_from_saved_state(saved_in, here) else 0
