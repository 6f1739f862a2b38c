"""Where a bench's CPU went: the machine's busy share, and the CPU time of each process tree it started.

On a machine without a GPU every part shares the same cores: vLLM's decoding, and in the other arm
the bubbles' prefill, the dispatcher, the front door and Redis beside training. These figures show
how much of the machine each took while an arm ran, so a latency that differs between arms can be
set beside the compute each side had (`bench/pd_vllm.py`). Read from Linux's /proc: where it is not
there (another OS), every figure is None.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
#: Clock ticks per second, the unit of /proc's CPU times.
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Sample:
    """CPU seconds at one moment: the machine's busy and total time (every core), and each child
    of the sampling process's tree (its pid, what it runs, the CPU time of it and every descendant
    alive then)."""

    busy_s: float
    total_s: float
    trees: dict[int, tuple[str, float]]


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, its own user + system CPU seconds) from /proc/PID/stat; None if it is gone."""
    try:
        raw = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()  # after the command's name, which may hold spaces
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / TICKS


def _cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def sample(root: int | None = None) -> Sample | None:
    """Now: the machine's CPU seconds, and each child of `root` (default: this process) with the
    CPU seconds of its whole tree. None where /proc is not there."""
    try:
        fields = (PROC / "stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + ticks[4]
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    own: dict[int, float] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (st := _stat(entry.name)) is not None:
            parent[int(entry.name)], own[int(entry.name)] = st
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)

    def tree(pid: int) -> float:
        return own.get(pid, 0.0) + sum(tree(c) for c in children.get(pid, ()))

    trees = {c: (_cmdline(c), tree(c)) for c in children.get(root, ())}
    return Sample(busy_s=(sum(ticks) - idle) / TICKS, total_s=sum(ticks) / TICKS, trees=trees)


def used(before: Sample | None, after: Sample | None, labels: dict[str, str]) -> dict[str, float | None]:
    """Between two samples: ``machine_busy_share`` (of every core's time), and per label the CPU
    seconds of the trees whose command line holds `labels[label]` (``<label>_cpu_s``). A tree that
    started or ended between the two counts from zero or is left out."""
    out: dict[str, float | None] = {"machine_busy_share": None, **{f"{k}_cpu_s": None for k in labels}}
    if before is None or after is None:
        return out
    if after.total_s > before.total_s:
        out["machine_busy_share"] = round((after.busy_s - before.busy_s) / (after.total_s - before.total_s), 3)
    for label, needle in labels.items():
        spent = 0.0
        for pid, (cmd, cpu) in after.trees.items():
            if needle in cmd:
                spent += cpu - before.trees.get(pid, (cmd, 0.0))[1]
        out[f"{label}_cpu_s"] = round(spent, 2)
    return out
