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

A weight says how much CPU a thread gets, not how soon. Under EEVDF (Linux 6.6 and later) a thread
that wakes runs once its virtual deadline is the earliest, and that deadline lies a slice (its
request size: 0.7 ms x (1 + log2 cores), 1.4 ms on 2 cores) of weighted time ahead, the longer the
lower its weight: so the prefill thread, woken by a bubble start while training threads are
runnable, could wait out their slices before its first block runs. Since Linux 6.12 a thread may
ask for a shorter slice (`sched_setattr`'s `sched_runtime` for SCHED_OTHER): the prefill thread
asks for `PREFILL_SLICE_US`, which brings its deadline, and so its start, forward without raising
its share (the nice value still sets that). Older kernels ignore the request; where the call
itself fails the nice value is set alone (said once in the log). `bench/bubble_fill.py` measures
the effect.

`BUBBLETEA_COMPUTE_PRIORITY=normal` leaves every thread at 0 (for comparison: `bench/bubble_fill.py
--priority normal`). Raising a nice value needs no privilege; on a system without per-thread
priorities the call is a no-op, said once in the log.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

from shared.runtime.logs import get_logger

log = get_logger(__name__)

TRAIN_NICE = 5
PREFILL_NICE = 15
#: The EEVDF slice the prefill thread asks for (microseconds; the kernel clamps it to 0.1-100 ms).
PREFILL_SLICE_US = 100

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


def prefill_slice_us() -> int:
    return PREFILL_SLICE_US if _enabled else 0


def lower_this_thread(nice: int, slice_us: int = 0) -> None:
    """Set the calling thread's nice value to `nice` and, with `slice_us`, ask for that EEVDF
    slice (a thread pool's initializer)."""
    if nice <= 0 and slice_us <= 0:
        return
    try:
        if slice_us > 0:
            _set_fair_attr(nice, slice_us * 1000)
        else:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as exc:  # not Linux, or not allowed: run at normal priority
        if slice_us > 0:  # sched_setattr is missing or refused: the nice value alone still helps
            _warn_once("could not ask for a short scheduler slice; the thread keeps the kernel's", exc)
            lower_this_thread(nice)
        else:
            _warn_once("could not lower a compute thread's priority; it runs at normal priority", exc)


def thread_nice() -> int:
    """The calling thread's nice value (for tests and logs)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def thread_slice_us() -> int:
    """The calling thread's EEVDF slice in microseconds: the kernel's default, or the one it asked
    for (0 before Linux 6.12, which does not report it)."""
    attr = _SchedAttr()
    _syscall("sched_getattr", threading.get_native_id(), ctypes.byref(attr), ctypes.sizeof(attr), 0)
    return attr.sched_runtime // 1000


def _warn_once(what: str, exc: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(what, error=str(exc))


# --- sched_setattr / sched_getattr (not in Python's os module) ---------------------------------


class _SchedAttr(ctypes.Structure):
    """`struct sched_attr` (include/uapi/linux/sched/types.h), the size with utilization clamps."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),  # for SCHED_OTHER since Linux 6.12: the requested slice
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


#: (sched_setattr, sched_getattr) syscall numbers per machine.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}.get(platform.machine(), (-1, -1))
_SCHED_OTHER = 0


def _syscall(name: str, *args: object) -> None:
    """Call `sched_setattr` or `sched_getattr`; OSError when unknown here or refused."""
    number = _SYSCALLS[0 if name == "sched_setattr" else 1]
    if number < 0:
        raise OSError(f"{name} is not known on {platform.machine()}")
    if ctypes.CDLL(None, use_errno=True).syscall(number, *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _set_fair_attr(nice: int, slice_ns: int) -> None:
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=_SCHED_OTHER, sched_nice=nice)
    attr.sched_runtime = slice_ns
    _syscall("sched_setattr", threading.get_native_id(), ctypes.byref(attr), 0)
