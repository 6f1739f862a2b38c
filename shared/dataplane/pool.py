"""Receive buffers kept for reuse by the data plane (`plane.py`): a fresh 64 MB receive buffer
costs more in page faults than the transfer itself on this class of machine (bench/transport.py)."""

from __future__ import annotations

import threading

import torch

#: Buffers kept per (dtype, shape).
POOL_PER_SHAPE = 8


class BufferPool:
    """Receive buffers by (dtype, shape), handed back with `release` once the tensor is dead."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        with self._lock:
            free = self._free.get((dtype, shape))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype)

    def release(self, t: torch.Tensor) -> None:
        """Take back a buffer nothing uses any more. A received activation became a leaf that
        required grad (the stage's input): both are reset, or the next use would accumulate
        into a stale `.grad`."""
        t.grad = None
        if t.requires_grad:
            t.requires_grad_(False)
        key = (t.dtype, tuple(t.shape))
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < POOL_PER_SHAPE:
                free.append(t)
