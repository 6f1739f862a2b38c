"""The dispatcher's indexes (pure): which open bubbles a trigger still has to visit, in order.

`DispatchState` (dispatch.py) used to visit every open bubble and every idle worker on every trigger;
at thousands of workers (the simulator's scale) that cost grew with the square of the cluster. These
indexes let it skip the bubbles that cannot take anything, with exactly the decisions of visiting
everything (tests/unit/test_dispatch.py drives both on long random input sequences).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shared.policies.packing import places_any


@dataclass(frozen=True, slots=True)
class Head:
    """The first waiting request packing would consider: its KV bytes, and the predicted seconds of
    its remaining layers and of one of them."""

    kv_bytes: int
    whole_s: float
    layer_s: float

    def blocks(self, left: float, free_memory: int) -> bool:
        """Packing `left` seconds and `free_memory` bytes would plan nothing: the head fits in that
        memory, so packing stops at it, and not even one of its layers fits in `left`."""
        return self.kv_bytes <= free_memory and not places_any(self.whole_s, self.layer_s, left)


BubbleKey = tuple[float, int, str]  # (started, opened rank, worker): the order bubbles are visited in


class RoomIndex:
    """The open bubbles a trigger visits, in visiting order, less those set aside: a bubble whose
    left seconds did not hold even one layer of the queue's head (that fits its memory). Its left
    seconds never grow until a report gives some back (which `add`s it again), and packing places
    nothing in less room than did not hold something, so it stays aside while the head needs more
    than it had and fits its memory; `release` brings back the others for a new head."""

    __slots__ = ("_aside", "_by_left", "_by_memory", "_visit")

    def __init__(self, keys: Iterable[BubbleKey] = ()) -> None:
        self._visit: list[BubbleKey] = sorted(keys)
        self._aside: dict[BubbleKey, tuple[float, int]] = {}  # key -> (left seconds, free memory) then
        self._by_left: list[tuple[float, BubbleKey]] = []
        self._by_memory: list[tuple[int, BubbleKey]] = []

    def first(self) -> BubbleKey | None:
        return self._visit[0] if self._visit else None

    def after(self, key: BubbleKey) -> BubbleKey | None:
        i = bisect_right(self._visit, key)
        return self._visit[i] if i < len(self._visit) else None

    def add(self, key: BubbleKey) -> None:
        self._unset(key)
        add_sorted(self._visit, key)

    def remove(self, key: BubbleKey) -> None:
        self._unset(key)
        discard_sorted(self._visit, key)

    def set_aside(self, key: BubbleKey, left: float, memory: int) -> None:
        discard_sorted(self._visit, key)
        self._aside[key] = (left, memory)
        insort(self._by_left, (left, key))
        insort(self._by_memory, (memory, key))

    def release(self, head: Head) -> None:
        """Back to the visit: the bubbles set aside that had room for some of `head` (a suffix by
        left seconds: placing is monotone in the room) or too little memory for it (a prefix)."""
        if not self._aside:
            return
        i = bisect_left(self._by_left, True, key=lambda e: places_any(head.whole_s, head.layer_s, e[0]))
        j = bisect_left(self._by_memory, (head.kv_bytes,))
        for _, key in self._by_left[i:] + self._by_memory[:j]:
            self.add(key)

    def _unset(self, key: BubbleKey) -> None:
        was = self._aside.pop(key, None)
        if was is not None:
            discard_sorted(self._by_left, (was[0], key))
            discard_sorted(self._by_memory, (was[1], key))


def add_sorted(index: list[Any], item: Any) -> None:
    """Put `item` in the sorted list `index` unless it is there."""
    i = bisect_left(index, item)
    if i == len(index) or index[i] != item:
        index.insert(i, item)


def discard_sorted(index: list[Any], item: Any) -> None:
    """Take `item` out of the sorted list `index` if it is there."""
    i = bisect_left(index, item)
    if i < len(index) and index[i] == item:
        del index[i]
