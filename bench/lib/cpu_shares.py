"""Each process's share of a core while a benchmark runs: this process and every one it started (/proc)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from bench.lib.procfs import command_words


class CpuSampler:
    """Every `PERIOD_S`, the CPU time (user + system) of this process and of every process it
    started, directly or not (/proc): each one's share of one core while it was seen (1.0 = a
    whole core). Keyed "<service>:<pid>"."""

    PERIOD_S = 0.25

    def __init__(self) -> None:
        self.first: dict[int, tuple[float, float]] = {}
        self.last: dict[int, tuple[float, float]] = {}
        self.names: dict[int, str] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.PERIOD_S)

    def sample(self) -> None:
        now, parent, cpu = time.monotonic(), {}, {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid = int(d.name)
            parent[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
        mine, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            kids = [p for p, pp in parent.items() if pp in frontier and p not in mine]
            mine.update(kids)
            frontier = kids
        for pid in mine:
            self.first.setdefault(pid, (now, cpu[pid]))
            self.last[pid] = (now, cpu[pid])
            # Named again until it resolves: a stage worker forked by the launcher's fork server
            # shows the server's command line until its first moments set its own (setproctitle).
            if self.names.get(pid, "?") in UNRESOLVED:
                self.names[pid] = _service_name(pid)

    def shares(self) -> dict[str, float]:
        out = {}
        for pid, (t1, c1) in self.last.items():
            t0, c0 = self.first[pid]
            if t1 - t0 >= 1.0:
                out[f"{self.names[pid]}:{pid}"] = round((c1 - c0) / (t1 - t0), 3)
        return out


#: Names that may still change: unknown, or a fork server's child before it took its own title.
UNRESOLVED = ("?", "python", "python3", "forkserver")


def _service_name(pid: int) -> str:
    words = command_words(pid)
    if words is None:
        return "?"
    if any("multiprocessing.forkserver" in w for w in words):
        return "forkserver"  # the launcher's fork server (bubbletea/launcher/forked.py), itself
    for w in words:
        if w.startswith("services.") or w in ("loadgen", "bench/bubble_fill.py"):
            return w.removeprefix("services.")
    return Path(words[0]).name if words else "?"


def by_service(runs: Any) -> dict[str, float]:
    """Each service's highest share of a core over `runs` (`CpuSampler.shares` each), highest first."""
    out: dict[str, float] = {}
    for cpu in runs:
        for key, share in cpu.items():
            name = key.rsplit(":", 1)[0]
            out[name] = max(out.get(name, 0.0), share)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
