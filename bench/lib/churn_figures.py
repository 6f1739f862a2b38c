"""bench/churn.py's figures (pure): the fault schedule, what each arm trained and served, and the
picture. Nothing here runs a service; the bench records, these functions count.

* **Useful iterations**: an iteration counts once, when every stage of some replica has reported it
  done (that replica stepped it: the run's state after it exists, and the run goes on from it; a
  replica whose step never came because a worker was lost takes that state over), within the arm's
  window; an (iteration, replica, stage) reported in two generations was trained twice, and is
  counted apart (`redone`), never as useful twice.
* **Kill to training again**: from a fault to the moment the run trained again: the last of the
  "joined the run" lines of the first generation after the fault that every slot joined.
* **SLO attainment**: of every request sent, the share answered within the TTFT objective (an error,
  a refusal or a timeout is a miss).
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from shared.wire import IterationDone

#: What a control-plane fault kills, in turn.
CONTROL = ("dispatcher", "prefill_queue", "redis")


@dataclass(frozen=True)
class Fault:
    at_s: float  # offset from the arm's start
    kind: str  # "worker", or one of CONTROL


def schedule(
    duration_s: float, *, mtbf_s: float, every_s: float | None, control_mtbf_s: float, seed: int
) -> list[Fault]:
    """The faults of one run, the same for every arm given the seed: stage workers at Poisson
    arrivals with mean gap `mtbf_s` (or every `every_s` exactly), and the control plane's services in
    turn at Poisson arrivals with mean gap `control_mtbf_s` (0: none); none in the last tenth of the
    run, which is left to settle."""
    rng = random.Random(seed)
    end = 0.9 * duration_s
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += every_s if every_s is not None else rng.expovariate(1 / mtbf_s)
        if t >= end:
            break
        faults.append(Fault(round(t, 3), "worker"))
    if control_mtbf_s > 0:
        t, i = 0.0, 0
        while (t := t + rng.expovariate(1 / control_mtbf_s)) < end:
            faults.append(Fault(round(t, 3), CONTROL[i % len(CONTROL)]))
            i += 1
    return sorted(faults, key=lambda f: f.at_s)


def training(done: Sequence[IterationDone], stages: int, start: float, end: float) -> dict[str, Any]:
    """Useful iterations in [start, end] (wall clock), the times each became complete, and the
    iterations trained twice."""
    reported: dict[int, dict[tuple[int, int], list[IterationDone]]] = {}
    for m in done:
        reported.setdefault(m.iteration, {}).setdefault((m.replica, m.stage), []).append(m)
    complete = []
    for by_slot in reported.values():
        replicas = {d for d, _ in by_slot}
        stepped = [
            max(min(m.ended for m in by_slot[(d, k)]) for k in range(stages))  # its first completion there
            for d in replicas
            if all((d, k) in by_slot for k in range(stages))
        ]
        if stepped and start <= (at := min(stepped)) <= end:
            complete.append(at)
    redone = sorted({it for it, by_slot in reported.items() for ms in by_slot.values() if len(ms) > 1})
    return {"useful_iterations": len(complete), "completed_at": sorted(complete), "redone_iterations": redone}


JOINED = re.compile(r"^ts=(\S+) .*msg=\"?joined the run\"? .*generation=(\d+)")


def log_time(stamp: str) -> float:
    """A log line's `ts=` stamp (UTC, ISO 8601 with a Z) as wall-clock seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def rounded(v: float | None) -> float | str | None:
    """A figure for the JSON line: to 2 decimals (None stays None; a fault that never recovered,
    infinite, is the string "inf": JSON has no infinity)."""
    if v is None:
        return None
    return "inf" if math.isinf(v) else round(v, 2)


def recovered_in(back: float | None) -> float:
    """A fault's time to recover, for its percentiles: one that never recovered counts, as infinite
    (issue 62: dropping it made the p99 of a run that lost a fault look like a calm one's)."""
    return math.inf if back is None else back


def joins(logs: Iterable[Path]) -> dict[int, list[float]]:
    """Every "joined the run" line of the stage workers' logs: generation -> wall-clock times."""
    out: dict[int, list[float]] = {}
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            if m := JOINED.search(line):
                at = log_time(m.group(1))
                out.setdefault(int(m.group(2)), []).append(at)
    return out


def back_after(fault_at: float, generation_then: int, joined: dict[int, list[float]], slots: int) -> float | None:
    """Seconds from a fault (wall clock, the generation it happened in) to the run training again:
    the first later generation every slot joined (None: none did)."""
    for gen in sorted(g for g in joined if g > generation_then):
        if len(joined[gen]) >= slots:
            return max(0.0, max(joined[gen]) - fault_at)
    return None


def serving(load: dict[str, Any], slo_ms: float) -> dict[str, Any]:
    """SLO attainment of every request sent (loadgen's per-request lists), and its errors."""
    ttfts, errors, sent = load.get("ttfts", []), load.get("errors", []), load.get("send_times", [])
    good = [not e and t * 1000 <= slo_ms for t, e in zip(ttfts, errors, strict=True)]
    return {
        "requests_sent": len(good),
        "requests_answered": sum(not e for e in errors),
        "slo_attainment": round(sum(good) / len(good), 4) if good else None,
        "errors": load.get("error_counts", {}),
        "good": good,
        "send_times": sent,
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def windows(
    times: Sequence[float], good: Sequence[bool], start: float, end: float, width: float
) -> list[tuple[float, float]]:
    """SLO attainment per window of `width` s from `start`: (window middle - start, share good)."""
    out = []
    t = start
    while t < end:
        hit = [g for s, g in zip(times, good, strict=True) if t <= s < t + width]
        if hit:
            out.append((t + width / 2 - start, sum(hit) / len(hit)))
        t += width
    return out


def picture(arms: dict[str, dict[str, Any]], path: Path, slo_device_ms: float, k: float) -> None:
    """Useful iterations and SLO attainment over time, one line per arm, each fault marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 6.5))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for name, arm in arms.items():
        start = arm["start"]
        xs = [t - start for t in arm["completed_at"]]
        (line,) = top.step(xs, range(1, len(xs) + 1), where="post", label=name)
        w = windows(arm["send_times"], arm["good"], start, arm["end"], 10.0)
        bottom.plot([x for x, _ in w], [y for _, y in w], marker=".", color=line.get_color(), label=name)
        for f in arm["faults"]:
            for ax in (top, bottom):
                ax.axvline(f["at"] - start, color=line.get_color(), alpha=0.25, lw=0.8)
    top.set_ylabel("useful iterations")
    bottom.set_ylabel(f"SLO attainment, 10 s windows\n(TTFT <= {slo_device_ms:g} device ms, k = {k:g})")
    bottom.set_xlabel("seconds since the load started (wall clock); faint lines: faults")
    bottom.set_ylim(-0.02, 1.02)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("Training and serving under churn (bench/churn.py)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
