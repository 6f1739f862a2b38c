"""Where a worker's inbox consumer leaves tensors for the schedule runner to pick up.

A tensor *arrives* when the transport has it: its data-plane receive returned (`landed`, called
from that receive's own thread), or, for a tensor held until the WAN model releases it, when the
release is read. That moment, not when the event loop later gets round to `put`, is what the
prefill thread polls (`arrived`) and what a bubble's overrun is timed from (`arrived_at`): any
delay of the loop or the interpreter lock after it counts as training waiting, as it does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from services.stage_worker.port.tensors import TensorKey


class Mailbox:
    """One-shot slots, one per received tensor (`TensorKey`). `put` is idempotent (a redelivered
    message is dropped), `take` waits."""

    def __init__(self) -> None:
        self._items: dict[TensorKey, Any] = {}
        self._waiters: dict[TensorKey, asyncio.Future[Any]] = {}
        self._taken: set[TensorKey] = set()
        self._arrived_at: dict[TensorKey, float] = {}
        self._landed: set[TensorKey] = set()

    def landed(self, key: TensorKey, at: float) -> None:
        """`key` is here as of `at` (wall clock), though not yet `put`. Safe to call from any thread
        (the receive's): a set add and a dict setdefault are atomic under the GIL."""
        self._arrived_at.setdefault(key, at)
        self._landed.add(key)

    def put(self, key: TensorKey, value: Any) -> None:
        if key in self._taken or key in self._items:
            return  # duplicate delivery (at-least-once bus): the first copy wins
        self._arrived_at.setdefault(key, time.time())  # `landed` may have stamped it sooner
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(value)
            self._taken.add(key)
        else:
            self._items[key] = value

    def ready(self, key: TensorKey) -> bool:
        return key in self._items

    def arrived(self, key: TensorKey) -> bool:
        """Whether `key` has landed or was put (taken or not). Safe to call from another thread: a
        prefill thread polls it between layers (set/dict membership is atomic under the GIL)."""
        return key in self._landed or key in self._items or key in self._taken

    def arrived_at(self, key: TensorKey) -> float | None:
        """When `key` arrived (wall clock: landed, else put), or None if it has not."""
        return self._arrived_at.get(key)

    async def take(self, key: TensorKey) -> Any:
        if key in self._items:
            self._taken.add(key)
            return self._items.pop(key)
        waiter = self._waiters.setdefault(key, asyncio.get_running_loop().create_future())
        return await waiter

    def reset(self) -> None:
        """Forget everything (the run resumes from a checkpoint and replays iterations): held
        tensors, what was taken, and any waiter (cancelled; its iteration was cut short)."""
        for waiter in self._waiters.values():
            waiter.cancel()
        self._items.clear()
        self._waiters.clear()
        self._taken.clear()
        self._arrived_at.clear()
        self._landed.clear()

    def forget_before(self, keep: Callable[[TensorKey], bool]) -> None:
        """Drop bookkeeping of taken keys for which ``keep(key)`` is false (bounded memory)."""
        self._taken = {k for k in self._taken if keep(k)}
        self._arrived_at = {k: t for k, t in self._arrived_at.items() if keep(k)}
        self._landed = {k for k in self._landed if keep(k)}
