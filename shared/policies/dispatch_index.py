"""The dispatcher's index (pure): which workers may take work, in the order a trigger offers it.

`DispatchState` (dispatch.py) offers waiting requests to the worker with the most credit to spare
(room) first. Visiting every worker on every trigger would cost the cluster's size each time (the
simulator runs thousands); this index keeps the workers with room sorted, so a trigger costs what
it sends, with exactly the decisions of visiting everything (tests/unit/test_dispatch.py drives
both on long random input sequences).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator


class CreditIndex:
    """Workers with room (> 0), most room first, ties by name. A worker's entry changes only when
    its room does (work sent or used, a bubble opened or closed), which the caller reports (`update`)."""

    __slots__ = ("_keys", "_sorted")

    def __init__(self) -> None:
        self._keys: dict[str, tuple[float, str]] = {}
        self._sorted: list[tuple[float, str]] = []

    def update(self, worker: str, room: float) -> None:
        """`worker` has `room` seconds to spare now: in the index if positive, out otherwise."""
        self.discard(worker)
        if room > 0:
            key = (-room, worker)
            self._keys[worker] = key
            insort(self._sorted, key)

    def discard(self, worker: str) -> None:
        key = self._keys.pop(worker, None)
        if key is not None:
            del self._sorted[bisect_left(self._sorted, key)]

    def first(self, skip: set[str]) -> str | None:
        """The roomiest worker not in `skip` (workers that took nothing in this pass)."""
        for _, worker in self._sorted:
            if worker not in skip:
                return worker
        return None

    def clear(self) -> None:
        self._keys.clear()
        self._sorted.clear()

    def __contains__(self, worker: str) -> bool:
        return worker in self._keys

    def __iter__(self) -> Iterator[str]:
        return (w for _, w in self._sorted)

    def __len__(self) -> int:
        return len(self._sorted)
