"""The entries a consumer has in hand: delivered to it and not yet acked, each handled by a task in
flight, held after its handler returned `HOLD` (until the service releases it), or done and
waiting for its XACK to be confirmed (`acking`).

Each carries when its idle time in Redis was last reset (its handler's start, its holding, or a
refresh by the reclaim loop): the reclaim loop refreshes those that grow old, so that a slow but
live handler, a held entry, or one whose ack is slow to land, is not taken over by a peer
(`shared.bus.reclaim`). An entry stays in hand until Redis confirmed its XACK: between its
handler's end and that, a re-read of the consumer's own pending entries, or its own reclaim pass,
would otherwise hand it to a handler again. The consumer's
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
        #: entry id -> when its idle time was last reset: its effect happened, its XACK not confirmed
        self._acking: dict[str, float] = {}

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

    def acking(self, entry_id: str, now: float) -> None:
        """The entry's effect happened and its XACK is queued: in hand until `acked`. Its idle time
        was last reset when its handler started or it was held (else, unknown here, `now`)."""
        self._acking[entry_id] = self._started.get(entry_id, self._held.get(entry_id, now))

    def acked(self, ids: Iterable[str]) -> None:
        """Redis confirmed the XACK of `ids`."""
        for entry_id in ids:
            self._acking.pop(entry_id, None)

    # --- what the loops ask ----------------------------------------------------------------

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._tasks or entry_id in self._held or entry_id in self._acking

    @property
    def in_flight(self) -> int:
        """Entries whose handler runs."""
        return len(self._tasks)

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def unacked(self) -> int:
        """Entries done whose XACK is not confirmed yet."""
        return len(self._acking)

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
        """The entries whose idle time was last reset before `horizon`: handled, held, then acking."""
        return [i for table in self._tables() for i, t in table.items() if t < horizon]

    def refreshed(self, ids: list[str], now: float) -> None:
        """The idle time of `ids` was reset at `now` (those still in hand)."""
        for table in self._tables():
            for entry_id in ids:
                if entry_id in table:
                    table[entry_id] = now

    def _tables(self) -> tuple[dict[str, float], ...]:
        return (self._started, self._held, self._acking)
