"""The entries a consumer has in hand: delivered to it and not yet acked, each handled by a task in
flight or held after its handler returned `HOLD` (until the service releases it).

Each carries when its idle time in Redis was last reset (its handler's start, its holding, or a
refresh by the reclaim loop): the reclaim loop refreshes those that grow old, so that a slow but
live handler, or a held entry, is not taken over by a peer (`shared.bus.reclaim`). The consumer's
read loop and its reclaim loop share one `InHand`. tests/integration/test_bus.py covers it (a slow
live handler not stolen, a held entry ours until released, drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class InHand:
    """A consumer's entries in flight and held. `sequential`: its handlers run one batch at a time
    in one task; `slots`: at most this many handler tasks at once (1 when sequential)."""

    def __init__(self, *, sequential: bool, slots: int) -> None:
        self.sequential, self.slots = sequential, slots
        self._tasks: dict[str, asyncio.Task[object]] = {}  # entry id -> the task handling it
        self._started: dict[str, float] = {}  # entry id -> when its handler began (monotonic)
        self._held: dict[str, float] = {}  # entry id -> when it was held (monotonic)

    # --- entries coming and going ----------------------------------------------------------

    def track(self, ids: Iterable[str], task: asyncio.Task[object], now: float) -> None:
        """`task` handles the entries `ids` from `now`."""
        for entry_id in ids:
            self._tasks[entry_id] = task
            self._started[entry_id] = now

    def handled(self, ids: Iterable[str]) -> None:
        """The task handling `ids` ended."""
        for entry_id in ids:
            self._tasks.pop(entry_id, None)
            self._started.pop(entry_id, None)

    def hold(self, entry_id: str, now: float) -> None:
        """The entry's handler returned `HOLD`: it stays pending, ours, until `release`."""
        self._held[entry_id] = now

    def release(self, entry_id: str) -> None:
        """A held entry is acked (or was never held here)."""
        self._held.pop(entry_id, None)

    # --- what the loops ask ----------------------------------------------------------------

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._tasks or entry_id in self._held

    @property
    def in_flight(self) -> int:
        """Entries whose handler runs."""
        return len(self._tasks)

    @property
    def held(self) -> int:
        return len(self._held)

    def tasks(self) -> set[asyncio.Task[object]]:
        """The handler tasks running."""
        return set(self._tasks.values())

    def busy(self) -> int:
        """Handler slots in use: tasks running (a sequential consumer's batch is one)."""
        return len(self.tasks()) if self.sequential else len(self._tasks)

    def free(self) -> int:
        """Handler slots free."""
        return self.slots - self.busy()

    def older_than(self, horizon: float) -> list[str]:
        """The entries whose idle time was last reset before `horizon`: handled, then held."""
        return [i for table in (self._started, self._held) for i, t in table.items() if t < horizon]

    def refreshed(self, ids: list[str], now: float) -> None:
        """The idle time of `ids` was reset at `now` (those still in hand)."""
        for table in (self._started, self._held):
            for entry_id in ids:
                if entry_id in table:
                    table[entry_id] = now
