"""The virtual clock: a heap of timed callbacks, run in time order (ties in the order scheduled).

Every event is `(time, seq, fn, arg)`; running it calls `fn(time, arg)`. Tuples and bound methods
keep the loop cheap: an 8,192-GPU iteration is a few million of them.

Tested by: tests/unit/test_sim.py, tests/unit/test_sim_training.py.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

Handler = Callable[[float, Any], None]


class EventQueue:
    """A discrete-event loop on a virtual clock (seconds from 0)."""

    __slots__ = ("_heap", "_seq", "_stopped", "events", "now")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Handler, Any]] = []
        self._seq = itertools.count()
        self._stopped = False
        self.now = 0.0
        self.events = 0  # events run so far

    def at(self, t: float, fn: Handler, arg: Any = None) -> None:
        """Run `fn(t, arg)` at virtual time `t` (never before the present)."""
        if t < self.now:
            raise ValueError(f"an event at {t} was scheduled in the past (now {self.now})")
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def stop(self) -> None:
        """End `run` after the current event (what is still scheduled is dropped)."""
        self._stopped = True

    def run(self, until: float = math.inf) -> None:
        """Run events in time order until none is left, `stop` is called, or the next is past `until`."""
        heap, pop = self._heap, heapq.heappop
        self._stopped = False
        while heap and not self._stopped:
            if heap[0][0] > until:
                return
            t, _, fn, arg = pop(heap)
            self.now = t
            self.events += 1
            fn(t, arg)

    def __len__(self) -> int:
        return len(self._heap)
