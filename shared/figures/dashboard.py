"""The run's page as data (`DashboardView`): what the front door's live page and the report's
dashboard.html draw, built by one code from the messages that ride Redis.

Pure: messages and a clock reading (`now`, wall seconds) in, a JSON-able dict out. The live page
(services/prefill_queue/dashboard.py) feeds it from the run's streams and keys; the report
(bubbletea/report/) from a run folder's spans. Times on the page are device ms from the view's
origin: real ms / k, k the device time scale (`time_scale`).

* timeline: per stage worker ("<stage>.<replica>"), segments of kind `compute` (fwd, bwd,
  all-reduce, step), `bubble` (a wait span up to the arrival of the input it awaited,
  `runstats.bubble_end`), `prefill` (inside its bubble) and `wan` (reserved: no span says yet when
  a transfer was on the WAN; the WAN panel shows the links). Each segment has a sequence number:
  an update carries the segments newer than the last one sent.
* figures over the window: fill ratio and utilization (`runstats.utilization`), utilization with
  BubbleTea off (training alone), TTFT p50/p99 and SLO attainment of the answers this front door
  saw, the request totals (given by the caller, as /metrics counts them) and their rates.
* the WAN links' last reports, training's iteration time and loss, and the faults.

Tested by: tests/unit/test_dashboard_view.py, tests/integration/test_dashboard.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.figures.percentiles import percentile
from shared.figures.runstats import TRAINING_KINDS, bubble_end, utilization
from shared.policies.spans import Span
from shared.wire import IterationDone, LinkReport, PrefillOff, SpanRecord, WorkerFailed, WorkerJoined

#: The fault kinds the page marks (the contract with the browser tests).
FAULT_KINDS = ("worker-lost", "takeover", "drain", "recovery", "dispatcher-restart", "redis-restart")
#: The request outcomes the page counts, as the front door's `bubbletea:request_total` labels them.
OUTCOMES = {"answered": "success", "moved": "moved", "refused": "rejected", "failed": "failed"}
#: Faults kept (the newest): a run that loses a worker a minute for a day shows the last few hours.
FAULTS_KEPT = 200
#: Points kept per series (one per update at most).
SERIES_KEPT = 300
#: Iterations kept for training's panel.
ITERATIONS_KEPT = 200


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str  # one of FAULT_KINDS
    at: float  # wall clock
    text: str
    worker: str = ""  # "<stage>.<replica>" where one is named


def worker_id(stage: int, replica: int) -> str:
    """A stage worker as the page names it: "<stage>.<replica>" (pp.dp)."""
    return f"{stage}.{replica}"


def slot_worker(slot: str) -> str:
    """A slot name "r<replica>s<stage>" as `worker_id`; the name itself if it is not one."""
    if slot.startswith("r") and "s" in slot:
        replica, _, stage = slot[1:].partition("s")
        if replica.isdigit() and stage.isdigit():
            return worker_id(int(stage), int(replica))
    return slot


class DashboardView:
    """The rolling window of a run (the last `window_s` seconds) and its events, as the page shows them."""

    def __init__(
        self,
        run: str,
        *,
        time_scale: float = 1.0,
        window_s: float = 30.0,
        ttft_objective_ms: float | None = None,
        origin: float | None = None,
    ) -> None:
        self.run = run
        self.k = time_scale
        self.window_s = window_s
        self.objective_ms = ttft_objective_ms  # device ms
        self.origin = origin
        self._spans: deque[tuple[int, Span]] = deque()
        self._seq = 0
        self._answers: deque[tuple[float, float]] = deque()  # (wall, TTFT real ms) of answered requests
        self._totals: deque[tuple[float, dict[str, float]]] = deque()
        self._iterations: deque[tuple[float, int, float, float | None]] = deque(maxlen=ITERATIONS_KEPT)
        self._links: dict[str, LinkReport] = {}
        self._faults: deque[Fault] = deque(maxlen=FAULTS_KEPT)
        self._series: dict[str, deque[tuple[float, float]]] = {}
        self._lost: dict[str, float] = {}  # worker -> when it was lost, until someone takes its slot

    # --- feeding -----------------------------------------------------------------------------

    def ms(self, t: float) -> float:
        """Wall time `t` as device ms from the origin."""
        return round((t - (self.origin or 0.0)) * 1000 / self.k, 3)

    def add(self, message: Any, now: float) -> None:
        """One message read from the run's spans or events stream; others are ignored."""
        if self.origin is None:
            self.origin = now
        match message:
            case SpanRecord():
                self._seq += 1
                self._spans.append((self._seq, Span.from_record(message)))
            case IterationDone(stage=stage, iteration=it, started=t0, ended=t1, loss=loss):
                if loss is not None or stage == 0:
                    self._iterations.append((t1, it, (t1 - t0) * 1000 / self.k, loss))
            case LinkReport(src_dc=src, dst_dc=dst):
                self._links[f"{src}->{dst}"] = message
            case WorkerFailed(slot=slot, reason=reason):
                self.slot_lost(slot_worker(slot), now, reason)
            case WorkerJoined(stage=stage, replica=replica, worker=holder, at=at):
                w = worker_id(stage, replica)
                if self._lost.pop(w, None) is not None:
                    self.fault("takeover", at, f"{holder} took the slot of worker {w}", w)
            case PrefillOff(worker=slot, reason=reason, at=at):
                w = slot_worker(slot)
                self.fault("drain", at, f"worker {w} stopped taking prefill: {reason}", w)
        self._trim(now)

    def answer(self, at: float, ttft_ms: float) -> None:
        """A request this front door answered, with its TTFT (real ms)."""
        self._answers.append((at, ttft_ms))

    @property
    def trained(self) -> bool:
        """Whether an iteration has been seen: before it, the run is still forming."""
        return bool(self._iterations)

    def fault(self, kind: str, at: float, text: str, worker: str = "") -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {FAULT_KINDS}")
        self._faults.append(Fault(kind, at, text, worker))

    def slot_lost(self, worker: str, at: float, reason: str) -> None:
        """A slot's lease went with no end marker (its holder died); `add` of its successor's
        `WorkerJoined` then marks the takeover. A second notice of the same loss is ignored."""
        if worker not in self._lost:
            self._lost[worker] = at
            self.fault("worker-lost", at, f"worker {worker} lost: {reason}", worker)

    def slot_taken(self, worker: str, holder: str, at: float) -> None:
        """A new holder in the slot of a lost worker."""
        if self._lost.pop(worker, None) is not None:
            self.fault("takeover", at, f"worker {worker}'s slot taken by {holder}", worker)

    def totals(self, now: float, totals: Mapping[str, float]) -> None:
        """The request totals now (keys of `OUTCOMES`), for their rates."""
        self._totals.append((now, dict(totals)))
        self._trim(now)

    # --- reading ------------------------------------------------------------------------------

    def _trim(self, now: float) -> None:
        lo = now - self.window_s
        while self._spans and self._spans[0][1].end < lo:
            self._spans.popleft()
        for q in (self._answers, self._totals):
            while q and q[0][0] < lo:
                q.popleft()

    @property
    def seq(self) -> int:
        """The newest segment's sequence number."""
        return self._seq

    def segments(self, after: int = 0) -> list[list[Any]]:
        """The timeline's segments newer than sequence number `after`: [seq, worker, kind, start
        ms, end ms, iteration]."""
        out: list[list[Any]] = []
        for seq, s in self._spans:
            if seq <= after:
                continue
            w = worker_id(s.stage, s.replica)
            if s.kind == "wait":
                end, kind = bubble_end(s), "bubble"
            else:
                end, kind = s.end, "compute" if s.kind in TRAINING_KINDS else s.kind
            if kind in ("compute", "bubble", "prefill", "wan"):
                out.append([seq, w, kind, self.ms(s.start), self.ms(max(end, s.start)), s.iteration])
        return out

    def figures(self, now: float) -> list[dict[str, Any]]:
        """The page's figures: name, value (None: not known yet), label, and the /metrics sample
        that holds the same number, where there is one."""
        u = utilization(s for _, s in self._spans)
        ttfts = [t / self.k for _, t in self._answers]
        p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
        last = self._totals[-1][1] if self._totals else {}
        first_t, first = self._totals[0] if self._totals else (now, {})
        dt = (self._totals[-1][0] - first_t) if self._totals else 0.0
        # a refusal or a failure is a miss (`requests.slo_attainment`); the window's from the totals
        missed = sum(last.get(n, 0.0) - first.get(n, 0.0) for n in ("refused", "failed"))
        sent = len(ttfts) + missed
        slo = None
        if self.objective_ms is not None and sent:
            slo = sum(1 for t in ttfts if t <= self.objective_ms) / sent
        last_it = self._iterations[-1] if self._iterations else None
        losses = [it for it in self._iterations if it[3] is not None]
        out = [
            _fig("fill-ratio", u.fill_ratio if u.workers else None, "fill ratio (prefill in the bubbles)", share=True),
            _fig("utilization", u.busy if u.workers else None, "utilization, BubbleTea on", share=True),
            _fig(
                "utilization-off",
                u.training if u.workers else None,
                "utilization, BubbleTea off (training)",
                share=True,
            ),
            _fig("bubble-fraction", u.bubble if u.workers else None, "bubble fraction", share=True),
            _fig("ttft-p50-ms", p50, "TTFT p50 (device ms)"),
            _fig("ttft-p99-ms", p99, "TTFT p99 (device ms)"),
            _fig(
                "slo-attainment",
                slo,
                "SLO attainment" if self.objective_ms else "SLO attainment (no objective)",
                share=True,
            ),
            _fig("iteration-ms", last_it[2] if last_it else None, "iteration (device ms)"),
            _fig("loss", losses[-1][3] if losses else None, "loss"),
        ]
        for name, outcome in OUTCOMES.items():
            metric = f'bubbletea:request_total{{outcome="{outcome}"}}'
            out.append(_fig(f"{name}-total", last.get(name), f"{name}", metric))
            rate = (last.get(name, 0.0) - first.get(name, 0.0)) / dt if dt > 0 else None
            out.append(_fig(f"{name}-per-s", rate, f"{name} per s"))
        for f in out:  # the series drawn under the figures
            if f["name"] in ("fill-ratio", "utilization", "ttft-p50-ms", "ttft-p99-ms", "slo-attainment"):
                self._point(f["name"], now, f["value"])
        return out

    def _point(self, name: str, now: float, value: float | None) -> None:
        if value is None:
            return
        q = self._series.setdefault(name, deque(maxlen=SERIES_KEPT))
        if not q or self.ms(now) > q[-1][0]:
            q.append((self.ms(now), value))

    def view(self, now: float, *, after: int | None = None) -> dict[str, Any]:
        """The whole view (`after` None: a snapshot with every segment of the window) or an
        update (the segments newer than `after`)."""
        figures = self.figures(now)
        return {
            "run": self.run,
            "time_scale": self.k,
            "now_ms": self.ms(now),
            "window_ms": self.window_s * 1000 / self.k,
            "seq": self._seq,
            "segments": self.segments(after or 0),
            "figures": figures,
            "series": {name: list(q) for name, q in self._series.items()},
            "wan": [_link(name, r) for name, r in sorted(self._links.items())],
            "iterations": [[self.ms(t), it, ms, loss] for t, it, ms, loss in self._iterations],
            "faults": [
                {"kind": f.kind, "at_ms": self.ms(f.at), "text": f.text, "worker": f.worker} for f in self._faults
            ],
        }


def _fig(
    name: str, value: float | None, label: str, metric: str | None = None, *, share: bool = False
) -> dict[str, Any]:
    """A figure as the page draws it; `share`: a part of a whole, shown as a percentage."""
    return {"name": name, "value": value, "label": label, "metric": metric, "share": share}


def _link(name: str, r: LinkReport) -> dict[str, Any]:
    return {
        "link": name,
        "transfers": r.transfers,
        "in_flight": r.in_flight,
        "utilization": r.utilization,
        "bytes": r.bytes_sent,
        "late_p99_ms": r.late_p99_ms,
    }


def view_of_spans(run: str, spans: Iterable[Span], time_scale: float, ttfts_ms: Iterable[float] = ()) -> dict[str, Any]:
    """A finished run's view (the report's dashboard.html): every span, the window the whole run."""
    spans = sorted(spans, key=lambda s: s.start)
    if not spans:
        return DashboardView(run, time_scale=time_scale, origin=0.0).view(0.0)
    lo, hi = spans[0].start, max(s.end for s in spans)
    v = DashboardView(run, time_scale=time_scale, window_s=hi - lo + 1.0, origin=lo)
    for s in spans:
        v._seq += 1
        v._spans.append((v._seq, s))
    for t in ttfts_ms:
        v.answer(hi, t)
    return v.view(hi)
