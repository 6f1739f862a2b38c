"""The fill policy (pure): what a worker does with prefill batches around its bubbles.

Training is the owner, prefill the guest. The worker's fill executor (services/stage_worker/filler.py)
only obeys these decisions; its threads and Redis I/O hold no timing rule of their own, and the
simulator runs the same rules on a virtual clock.

* A batch that arrives while a bubble is open runs in it. A staged batch (`hold`) waits for the
  next bubble. Any other batch arrived too late (its bubble is over) and goes back unrun.
* A bubble predicted shorter than the guard is not worth filling: staged work waits for a longer one.
* Batches run in arrival order, one block (one layer of one request) at a time. A block may start
  only while the awaited training input has not arrived and, when the bubble's end is predicted and
  the block's time known, only if it would end before that end (training resumes within one block).
* When a bubble ends, the batches sent for it that did not run go back; staged ones stay for the next.
* A staged batch that no bubble has taken within `hold_s` goes back unrun (training paused or over),
  and the dispatcher queues its requests again.
* A preempted prefill resumes from its saved state only in the datacenter that saved it
  (`resume_layer`); a worker in another DC computes it again from its prompt.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from shared.spec.config import BubbleTea

#: A worker holds a staged batch this long at most; if no bubble starts by then it hands it back
#: unrun (the run may be over), and the requests queue again. The spec's default
#: (`bubbletea.hold_ms`), which the device time scale stretches like the gaps between bubbles.
HOLD_STAGED_S = 1.0


class Arrival(enum.StrEnum):
    """What to do with a batch that just arrived on a worker."""

    RUN = "run"  # a bubble is open: queue it for this bubble
    HOLD = "hold"  # staged for the next bubble: keep it until one starts (or `hold_s` passes)
    RETURN = "return"  # its bubble is over: hand it back unrun


@dataclass(frozen=True)
class Held:
    """A batch waiting on the worker, as the policy sees it."""

    batch_id: str
    staged: bool  # sent ahead for the worker's next bubble
    received: float  # when it arrived on the worker


@dataclass(frozen=True)
class FillPolicy:
    guard_s: float  # a bubble predicted shorter than this is not filled
    hold_s: float = HOLD_STAGED_S

    @classmethod
    def from_spec(cls, bt: BubbleTea) -> FillPolicy:
        """The policy a worker (or the simulator's executor) runs for the spec's `bubbletea` section."""
        return cls(guard_s=bt.guard_ms / 1000, hold_s=bt.hold_ms / 1000)

    def on_arrival(self, *, staged: bool, in_bubble: bool, redelivered: bool = False) -> Arrival:
        """`redelivered`: delivered before and never acked, so sent for a bubble of this slot's
        previous process. It goes back unrun: the dispatcher may already have requeued it (running
        it again would only duplicate that work), and if not, the report requeues it at once
        instead of when the report is overdue."""
        if redelivered:
            return Arrival.RETURN
        if in_bubble:
            return Arrival.RUN
        return Arrival.HOLD if staged else Arrival.RETURN

    def worth_filling(self, predicted_s: float) -> bool:
        return predicted_s >= self.guard_s

    def fill_until(self, started: float, predicted_s: float) -> float:
        """The moment no block may end after: the bubble's predicted end minus the guard."""
        return started + predicted_s - self.guard_s

    def next_batch(self, queued: list[Held]) -> int | None:
        """Index of the batch to run next (arrival order), or None when none is waiting."""
        return 0 if queued else None

    def may_start_block(
        self, *, input_arrived: bool, now: float, ends_at: float | None = None, block_s: float | None = None
    ) -> bool:
        """Whether the next block may start. `ends_at`: the bubble's predicted end minus the guard;
        `block_s`: the block's expected time (both None when unknown: only arrival stops it)."""
        if input_arrived:
            return False
        if ends_at is None or block_s is None:
            return True
        return now + block_s <= ends_at

    def blocks_that_start(self, *, start: float, block_s: float, need: int, ends_at: float) -> int:
        """How many of `need` back-to-back blocks of `block_s`, the first at `start`, `may_start_block`
        lets start while no input arrives: what a worker stepping block by block would run, in one
        step (the simulator's executor asks this at each block boundary it plans to)."""
        if block_s <= 0:
            return need
        n = min(need, max(0, math.floor((ends_at - start) / block_s)))
        may = self.may_start_block
        while n > 0 and not may(input_arrived=False, now=start + (n - 1) * block_s, ends_at=ends_at, block_s=block_s):
            n -= 1  # float rounding: the last block floor() allowed may not pass the rule itself
        while n < need and may(input_arrived=False, now=start + n * block_s, ends_at=ends_at, block_s=block_s):
            n += 1
        return n

    def at_bubble_end(self, queued: list[Held]) -> list[str]:
        """Ids of the batches to hand back unrun when a bubble ends: those sent for it."""
        return [h.batch_id for h in queued if not h.staged]

    def expired_holds(self, queued: list[Held], *, in_bubble: bool, now: float) -> list[str]:
        """Ids of staged batches no bubble took within `hold_s` (none while a bubble is open: it
        runs them or hands them back at its end)."""
        if in_bubble:
            return []
        return [h.batch_id for h in queued if h.staged and now - h.received >= self.hold_s]

    def at_close(self, queued: list[Held]) -> list[str]:
        """Ids of every batch to hand back when the worker stops: nothing more will run here."""
        return [h.batch_id for h in queued]


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
