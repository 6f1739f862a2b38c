"""Peak resident memory of a run's stage-worker processes: /proc polled in a thread (bench/train_tokens.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

from bench.lib.procfs import command_words

#: The module a stage worker runs (``python -m services.stage_worker``): what the poller looks for.
STAGE_WORKER_MODULE = "services.stage_worker"
#: Seconds between two polls of /proc.
POLL_S = 0.2


def _ppid(pid: int) -> int | None:
    """The parent of `pid` from /proc/<pid>/stat, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def descendants(root: int) -> Iterator[int]:
    """Every live process below `root` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            pid = int(entry.name)
            parent = _ppid(pid)
            if parent is not None:
                children.setdefault(parent, []).append(pid)
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        yield pid
        todo.extend(children.get(pid, ()))


def is_stage_worker(pid: int) -> bool:
    return STAGE_WORKER_MODULE in (command_words(pid) or ())


def vm_hwm_bytes(pid: int) -> int | None:
    """The peak resident set size of `pid` (VmHWM, reported in kB), None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class WorkerMemory:
    """Polls /proc in a thread for this process's stage-worker descendants and their VmHWM.

    Once `expected` workers have been found, only their status files are read (the whole of /proc
    is not scanned again), so the poller takes next to nothing from the run it measures."""

    def __init__(self, expected: int, interval: float = POLL_S) -> None:
        self.expected, self.interval = expected, interval
        self.peaks: dict[int, int] = {}  # pid -> peak RSS in bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-memory", daemon=True)

    def sample(self) -> None:
        pids = list(self.peaks) if len(self.peaks) >= self.expected else descendants(os.getpid())
        for pid in pids:
            if (pid in self.peaks or is_stage_worker(pid)) and (hwm := vm_hwm_bytes(pid)) is not None:
                self.peaks[pid] = max(hwm, self.peaks.get(pid, 0))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> WorkerMemory:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
