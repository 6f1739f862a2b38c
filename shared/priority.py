"""Compute never delays the control plane: CPU priorities of the threads that run torch.

On a machine whose cores are shared by the workers' compute and the services' event loops (the
dispatcher, the front door, the broker, each worker's own loop) and Redis, a loop that is ready to
run must not wait for a torch thread's time slice. Linux schedules threads, and a thread's nice
value is its own (`setpriority(PRIO_PROCESS, tid, n)` sets one thread): so each worker runs

* its training compute (the stage's torch thread) at `TRAIN_NICE`;
* its prefill compute (the fill executor's thread) at `PREFILL_NICE`, below training: a guest's
  work must not slow an owner's, in this worker or in another one on the same cores;

while everything else (event loops, data-plane threads, Redis, the other services) stays at 0.
CFS gives a runnable thread CPU in proportion to its weight (nice 0: 1024, 5: 335, 15: 36), so a
loop that wakes gets the core at once and training gets ~90% of what it shares with prefill.

`BUBBLETEA_COMPUTE_PRIORITY=normal` leaves every thread at 0 (for comparison: `bench/bubble_fill.py
--priority normal`). Raising a nice value needs no privilege; on a system without per-thread
priorities the call is a no-op, said once in the log.
"""

from __future__ import annotations

import os
import threading

from shared.logs import get_logger

log = get_logger(__name__)

TRAIN_NICE = 5
PREFILL_NICE = 15
#: The values of BUBBLETEA_COMPUTE_PRIORITY.
PRIORITIES = ("low", "normal")

_warned = False
_enabled = True


def configure(priority: str) -> None:
    """This process's `BUBBLETEA_COMPUTE_PRIORITY` (`Settings.compute_priority`)."""
    global _enabled
    _enabled = priority == "low"


def train_nice() -> int:
    return TRAIN_NICE if _enabled else 0


def prefill_nice() -> int:
    return PREFILL_NICE if _enabled else 0


def lower_this_thread(nice: int) -> None:
    """Set the calling thread's nice value to `nice` (a thread pool's initializer)."""
    global _warned
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as exc:  # not Linux, or not allowed: run at normal priority
        if not _warned:
            _warned = True
            log.warning("could not lower a compute thread's priority; it runs at normal priority", error=str(exc))


def thread_nice() -> int:
    """The calling thread's nice value (for tests and logs)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
