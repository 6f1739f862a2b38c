"""The dispatcher's state and decisions (pure): open bubbles, queued requests, what goes where.

The `dispatcher` service is a thin shell: it feeds this object bubble events, new requests and
workers' progress reports with a clock, and sends out the `Dispatch` decisions it returns.

* A request waits in the queue until some open bubble has room for (part of) it; packing is
  `shared.policies.packing.pack` with the learned `PrefillCostModel`.
* Dispatch happens at bubble start, and whenever a request arrives (or a report frees a request)
  while a bubble is open; a bubble's budget shrinks by what was already sent into it.
* A request is never in two bubbles at once; a worker's report moves it on (to the layer it
  reached) or out (done); what a worker could not finish is queued again at its resume point.
* A queued request whose deadline has passed is expired (the shell fails it explicitly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.policies.packing import Assignment, Candidate, budget, layered_cost, pack
from shared.policies.prefill_cost import PrefillCostModel


@dataclass
class Request:
    id: str
    tokens: int
    arrival: float
    kv_bytes: int
    deadline: float | None = None
    next_layer: int = 0
    in_bubble: str | None = None  # the worker running it now, if any


@dataclass
class Bubble:
    worker: str
    started: float
    predicted_s: float
    free_memory: int
    sent_s: float = 0.0  # predicted seconds of work already dispatched into this bubble
    sent_bytes: int = 0
    tag: object = None  # which of the worker's bubbles (e.g. (iteration, position)), to match its end


@dataclass(frozen=True)
class Dispatch:
    worker: str
    assignments: tuple[Assignment, ...]


@dataclass(frozen=True)
class Progress:
    """A worker's report on one request: the layer it reached and the seconds it spent."""

    id: str
    reached_layer: int
    seconds: float


@dataclass
class DispatchState:
    layers: int
    guard_s: float
    overhead_s: float
    max_batch: int
    order: str = "deadline"
    cost: PrefillCostModel = field(default_factory=PrefillCostModel)
    requests: dict[str, Request] = field(default_factory=dict)
    bubbles: dict[str, Bubble] = field(default_factory=dict)

    # --- events ----------------------------------------------------------------------------

    def add_request(self, req: Request, now: float) -> list[Dispatch]:
        if req.id not in self.requests:  # a redelivered request is already known
            self.requests[req.id] = req
        return self._fill_all(now)

    def bubble_start(
        self,
        worker: str,
        predicted_s: float,
        free_memory: int,
        now: float,
        *,
        started: float | None = None,
        tag: object = None,
    ) -> list[Dispatch]:
        """A worker waits for training input. `started` is when the bubble began on the worker
        (default `now`): the time the event took to get here is already gone from the budget."""
        self.bubbles[worker] = Bubble(worker, now if started is None else started, predicted_s, free_memory, tag=tag)
        return self._fill(worker, now)

    def bubble_end(self, worker: str, tag: object = None) -> None:
        """Training input arrived: send nothing more there (what runs stops at a layer boundary).
        With a `tag`, only the bubble it names is closed (an end that overtook the next start is
        ignored)."""
        b = self.bubbles.get(worker)
        if b is not None and (tag is None or b.tag == tag):
            del self.bubbles[worker]

    def report(self, worker: str, progress: list[Progress], now: float) -> tuple[list[str], list[Dispatch]]:
        """A worker finished (or was preempted in) a batch. Returns the ids now complete and any new
        dispatches the freed requests allow."""
        done: list[str] = []
        for p in progress:
            req = self.requests.get(p.id)
            if req is None or req.in_bubble != worker:
                continue  # stale or duplicate report
            ran = p.reached_layer - req.next_layer
            if ran > 0 and p.seconds > 0:
                self.cost.observe(req.tokens, p.seconds * self.layers / ran)  # scale to a whole prompt
            req.next_layer, req.in_bubble = max(req.next_layer, p.reached_layer), None
            if req.next_layer >= self.layers:
                done.append(p.id)
                del self.requests[p.id]
        return done, self._fill_all(now)

    def expire(self, now: float) -> list[str]:
        """Queued (not running) requests whose deadline has passed: removed, to be failed explicitly."""
        gone = [
            r.id for r in self.requests.values() if r.deadline is not None and r.deadline < now and r.in_bubble is None
        ]
        for rid in gone:
            del self.requests[rid]
        return gone

    def requeue(self, worker: str, ids: list[str], now: float) -> list[Dispatch]:
        """A batch sent to `worker` never reported back (lost with its worker, or stuck): its
        requests wait again at their last reported layer."""
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None and req.in_bubble == worker:
                req.in_bubble = None
        return self._fill_all(now)

    def worker_lost(self, worker: str) -> None:
        """A worker died: its running requests go back to the queue at their last reported layer."""
        self.bubbles.pop(worker, None)
        for r in self.requests.values():
            if r.in_bubble == worker:
                r.in_bubble = None

    # --- decisions -------------------------------------------------------------------------

    def _fill_all(self, now: float) -> list[Dispatch]:
        out: list[Dispatch] = []
        for worker in sorted(self.bubbles, key=lambda w: self.bubbles[w].started):
            out += self._fill(worker, now)
        return out

    def _fill(self, worker: str, now: float) -> list[Dispatch]:
        b = self.bubbles.get(worker)
        if b is None:
            return []
        left = budget(b.predicted_s, now - b.started, self.guard_s, self.overhead_s) - b.sent_s
        waiting = [
            Candidate(r.id, r.tokens, r.next_layer, r.arrival, r.kv_bytes, r.deadline)
            for r in self.requests.values()
            if r.in_bubble is None
        ]
        if left <= 0 or not waiting:
            return []
        plan = pack(
            waiting,
            budget_s=left,
            free_memory=b.free_memory - b.sent_bytes,
            layers=self.layers,
            cost=layered_cost(self.cost.predict_safe, self.layers),
            now=now,
            max_requests=self.max_batch,
            order=self.order,
        )
        if not plan.assignments:
            return []
        for a in plan.assignments:
            r = self.requests[a.id]
            r.in_bubble = worker
            b.sent_s += a.seconds
            b.sent_bytes += r.kv_bytes
        return [Dispatch(worker, plan.assignments)]
