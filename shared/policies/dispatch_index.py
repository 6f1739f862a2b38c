"""The dispatcher's index (pure): which workers may take work, in the order a trigger offers it.

`DispatchState` (dispatch.py) offers waiting requests to the worker with the most credit to spare
(room) first. Visiting every worker on every trigger would cost the cluster's size each time (the
simulator runs thousands); this index keeps the workers with room sorted, so a trigger costs what
it sends, with exactly the decisions of visiting everything (tests/unit/test_dispatch.py drives
both on long random input sequences).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Mapping

from shared.policies.decisions import Ignored
from shared.policies.dispatch_inputs import STUCK_BUBBLE_FACTOR, Bubble, Credit


class CreditIndex:
    """Workers with room (> 0), most room first, ties by name. A worker's entry changes only when
    its room does (work sent or used, a bubble opened or closed), which the caller reports (`update`)."""

    __slots__ = ("_keys", "_sorted")

    def __init__(self) -> None:
        self._keys: dict[str, tuple[float, str]] = {}
        self._sorted: list[tuple[float, str]] = []

    def update(self, worker: str, room: float) -> None:
        """`worker` has `room` seconds to spare now: in the index if positive, out otherwise."""
        key = (-room, worker)
        if self._keys.get(worker) == key:  # its room did not change: it stays where it is
            return
        self.discard(worker)
        if room > 0:
            self._keys[worker] = key
            insort(self._sorted, key)

    def discard(self, worker: str) -> None:
        key = self._keys.pop(worker, None)
        if key is not None:
            del self._sorted[bisect_left(self._sorted, key)]

    def first(self, skipped: int) -> str | None:
        """The roomiest worker after the `skipped` roomiest (those that took nothing in this pass).

        Within a pass the workers that took nothing are always the index's head: each was the
        roomiest left when it was asked, and a worker that takes work only loses room (it moves
        back, never ahead of them). So the next to ask is at position `skipped`, not found by
        scanning past them: a pass that asked every one of the 1,024 workers of an 8,192-GPU
        simulation scanned half a million entries (issue 63: 88 of 192 s at load 0.8)."""
        return self._sorted[skipped][1] if skipped < len(self._sorted) else None

    def clear(self) -> None:
        self._keys.clear()
        self._sorted.clear()

    def __contains__(self, worker: str) -> bool:
        return worker in self._keys

    def __iter__(self) -> Iterator[str]:
        return (w for _, w in self._sorted)

    def __len__(self) -> int:
        return len(self._sorted)


class OpenBubbles:
    """When each open bubble is taken as closed (its worker died in it, or its end was lost:
    `dispatch.STUCK_BUBBLE_FACTOR` times its expected length), soonest first. A tick pops only
    the bubbles that are due, so it costs what it closes, not the number of workers; an entry
    whose bubble has ended (or been replaced) meanwhile is skipped as it comes up."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Bubble]] = []
        self._seq = 0

    def opened(self, worker: str, bubble: Bubble, expected_s: float, unknown_s: float) -> None:
        """`worker`'s `bubble` opened, expected to last `expected_s` (its prediction, or the worker's
        typical bubble; 0: neither known, and then it is taken as closed after `unknown_s`)."""
        closes_at = bubble.started + (STUCK_BUBBLE_FACTOR * expected_s if expected_s > 0 else unknown_s)
        self._seq += 1
        heapq.heappush(self._heap, (closes_at, self._seq, worker, bubble))

    def close_stuck(
        self, now: float, workers: Mapping[str, Credit], reindex: Callable[[Credit], None]
    ) -> list[Ignored]:
        """Close each bubble due by `now` that is still its worker's open one (its requests then
        move or fail at their objective; what runs may still be answered: first answer wins), each
        with why; `reindex` is told of each worker whose bubble closed."""
        closed = []
        while self._heap and self._heap[0][0] < now:
            _, _, worker, bubble = heapq.heappop(self._heap)
            c = workers.get(worker)
            if c is None or c.bubble is None or c.bubble is not bubble:  # ended (or replaced) in time
                continue
            why = f"open {now - c.bubble.started:.3f}s, over {STUCK_BUBBLE_FACTOR:g} times its expected length"
            c.bubble = None
            reindex(c)
            closed.append(Ignored(f"bubble of {worker}", f"{why}: taken as closed"))
        return closed
