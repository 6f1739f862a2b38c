"""The dispatcher's state and decisions (pure): open bubbles, queued requests, what goes where.

The `dispatcher` service is a thin shell: it feeds this object bubble events, new requests and
workers' progress reports with a clock, and sends out the `Dispatch` decisions it returns.

* A request waits in the queue until some open bubble has room for (part of) it; packing is
  `shared.policies.packing.pack` with the learned `PrefillCostModel`.
* Dispatch happens at bubble start, and whenever a request arrives (or a report frees a request)
  while a bubble is open; a bubble's budget shrinks by what was already sent into it.
* A request is never in two bubbles at once; a worker's report moves it on (to the layer it
  reached) or out (done); what a worker could not finish is queued again at its resume point.
* A bubble's budget counts only work still outstanding there: a reported batch gives back its
  predicted time, so a worker that finishes early is topped up from the same bubble.
* **Staging**: when a bubble ends, the next one's first batch is sent at once and the worker holds
  it until a bubble long enough to use it starts (the worker knows each bubble's predicted length;
  it skips ones shorter than the guard). A bubble then starts filling without waiting for a round
  trip through the bus; the dispatcher tops it up once the bubble's own start event arrives. The
  staged batch is sized for the median of the worker's recent bubbles, capped at `stage_s`
  (requests held on an idle worker are not available to open bubbles elsewhere).
* **Keeping ahead**: while a bubble is open, at least `ahead_s` of work stays outstanding on its
  worker, also past the bubble's predicted budget (predictions are conservative, and one batch's
  end would otherwise leave the worker idle for a round trip to the dispatcher). Work beyond the
  budget is safe because the worker yields at the next layer boundary when training input arrives;
  `ahead_s = 0` (the default) keeps strictly to the budget. Measured on 2 shared cores, keeping
  8 ms ahead did not raise the fill ratio and slowed training more (more preemptions), so it is off.
* Packing uses the cost model's mean prediction, not a pessimistic one: a misprediction costs at
  most one layer's time, because the worker yields at the next layer boundary when training input
  arrives, and the guard covers that.
* A queued request whose deadline has passed is expired (the shell fails it explicitly).
"""

from __future__ import annotations

from collections import deque
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
    in_bubble: str | None = None  # the worker running (or holding) it now, if any
    assigned_s: float = 0.0  # predicted seconds of the work it was last sent with


@dataclass
class Bubble:
    worker: str
    started: float
    predicted_s: float
    free_memory: int
    sent_s: float = 0.0  # predicted seconds of work sent into this bubble and not yet reported
    sent_bytes: int = 0
    tag: object = None  # which of the worker's bubbles (e.g. (iteration, position)), to match its end


@dataclass(frozen=True)
class Dispatch:
    worker: str
    assignments: tuple[Assignment, ...]
    hold: bool = False  # staged for the worker's next bubble (it holds the batch until then)


#: Bubble lengths remembered per worker, to size the batch staged for its next bubble.
RECENT_BUBBLES = 8
#: Work is staged only on a worker that had a bubble this recently: one that stopped training
#: (run over, or dead) must not keep being handed requests.
STAGE_WINDOW_S = 2.0
#: A worker holds a staged batch this long at most; if no bubble starts by then it hands it back
#: unrun (the run may be over), and the requests queue again.
HOLD_STAGED_S = 1.0


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
    stage_next: bool = True
    stage_s: float = 1.0  # at most this much work staged for a worker's next bubble
    ahead_s: float = 0.0  # work kept outstanding in an open bubble beyond its budget (see the docstring)
    requests: dict[str, Request] = field(default_factory=dict)
    bubbles: dict[str, Bubble] = field(default_factory=dict)
    #: per worker: predicted seconds (and KV bytes) of the batch staged for its next bubble
    staged: dict[str, tuple[float, int]] = field(default_factory=dict)
    recent: dict[str, deque[float]] = field(default_factory=dict)
    free_memory: dict[str, int] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)  # the worker's last bubble event

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
        staged_s, staged_bytes = self.staged.pop(worker, (0.0, 0))
        self.bubbles[worker] = Bubble(
            worker, now if started is None else started, predicted_s, free_memory, staged_s, staged_bytes, tag=tag
        )
        self.recent.setdefault(worker, deque(maxlen=RECENT_BUBBLES)).append(predicted_s)
        self.free_memory[worker] = free_memory
        self.last_seen[worker] = now
        return self._fill(worker, now)

    def bubble_end(self, worker: str, tag: object = None, *, now: float = 0.0) -> list[Dispatch]:
        """Training input arrived: send nothing more there (what runs stops at a layer boundary).
        With a `tag`, only the bubble it names is closed (an end that overtook the next start is
        ignored)."""
        b = self.bubbles.get(worker)
        if b is not None and (tag is None or b.tag == tag):
            del self.bubbles[worker]
        self.last_seen[worker] = now
        return self.stage(worker, now)

    def stage(self, worker: str, now: float) -> list[Dispatch]:
        """The first batch of `worker`'s next bubble, sent now and held there until it starts
        (none if staging is off, something is staged already, or nothing fits)."""
        recent = self.recent.get(worker)
        if not self.stage_next or worker in self.staged or not recent or worker in self.bubbles:
            return []
        if now - self.last_seen.get(worker, -1e18) > STAGE_WINDOW_S:
            return []
        typical = sorted(recent)[len(recent) // 2]
        room = min(self.stage_s, typical - self.guard_s - self.overhead_s)
        plan = self._pack(max(0.0, room), self.free_memory.get(worker, 0), now)
        if not plan:
            return []
        secs, nbytes = self._assign(worker, plan)
        self.staged[worker] = (secs, nbytes)
        return [Dispatch(worker, plan, hold=True)]

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
            self._give_back(worker, req)
            req.next_layer, req.in_bubble = max(req.next_layer, p.reached_layer), None
            if req.next_layer >= self.layers:
                done.append(p.id)
                del self.requests[p.id]
        return done, self._fill_all(now)

    def expire(self, now: float) -> list[str]:
        """Requests past their deadline that are not running in an open bubble (queued, or staged
        on a worker): removed, to be failed explicitly. One a worker still runs finishes first."""
        gone = [
            r
            for r in self.requests.values()
            if r.deadline is not None and r.deadline < now and (r.in_bubble is None or r.in_bubble not in self.bubbles)
        ]
        for r in gone:
            if r.in_bubble is not None:
                self._give_back(r.in_bubble, r)
            del self.requests[r.id]
        return [r.id for r in gone]

    def requeue(self, worker: str, ids: list[str], now: float) -> list[Dispatch]:
        """A batch sent to `worker` never reported back (lost with its worker, or stuck): its
        requests wait again at their last reported layer."""
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None and req.in_bubble == worker:
                self._give_back(worker, req)
                req.in_bubble = None
        return self._fill_all(now)

    def worker_lost(self, worker: str) -> None:
        """A worker died: its running requests go back to the queue at their last reported layer."""
        self.bubbles.pop(worker, None)
        self.staged.pop(worker, None)
        self.recent.pop(worker, None)
        for r in self.requests.values():
            if r.in_bubble == worker:
                r.in_bubble = None

    # --- decisions -------------------------------------------------------------------------

    def _fill_all(self, now: float) -> list[Dispatch]:
        out: list[Dispatch] = []
        for worker in sorted(self.bubbles, key=lambda w: self.bubbles[w].started):
            out += self._fill(worker, now)
        for worker in sorted(self.recent):  # then stage work for idle workers' next bubbles
            out += self.stage(worker, now)
        return out

    def _fill(self, worker: str, now: float) -> list[Dispatch]:
        b = self.bubbles.get(worker)
        if b is None:
            return []
        left = max(budget(b.predicted_s, now - b.started, self.guard_s, self.overhead_s), self.ahead_s) - b.sent_s
        plan = self._pack(left, b.free_memory - b.sent_bytes, now)
        if not plan:
            return []
        secs, nbytes = self._assign(worker, plan)
        b.sent_s += secs
        b.sent_bytes += nbytes
        return [Dispatch(worker, plan)]

    def _pack(self, left: float, free_memory: int, now: float) -> tuple[Assignment, ...]:
        waiting = [
            Candidate(r.id, r.tokens, r.next_layer, r.arrival, r.kv_bytes, r.deadline)
            for r in self.requests.values()
            if r.in_bubble is None
        ]
        if left <= 0 or not waiting:
            return ()
        return pack(
            waiting,
            budget_s=left,
            free_memory=free_memory,
            layers=self.layers,
            cost=layered_cost(self.cost.predict, self.layers),
            now=now,
            max_requests=self.max_batch,
            order=self.order,
        ).assignments

    def _assign(self, worker: str, plan: tuple[Assignment, ...]) -> tuple[float, int]:
        secs, nbytes = 0.0, 0
        for a in plan:
            r = self.requests[a.id]
            r.in_bubble, r.assigned_s = worker, a.seconds
            secs += a.seconds
            nbytes += r.kv_bytes
        return secs, nbytes

    def _give_back(self, worker: str, req: Request) -> None:
        """A request left `worker` (reported or requeued): its share no longer counts there."""
        b = self.bubbles.get(worker)
        if b is not None:
            b.sent_s = max(0.0, b.sent_s - req.assigned_s)
            b.sent_bytes = max(0, b.sent_bytes - req.kv_bytes)
        elif worker in self.staged:
            secs, nbytes = self.staged[worker]
            left_s, left_b = max(0.0, secs - req.assigned_s), max(0, nbytes - req.kv_bytes)
            if left_s <= 0 and left_b <= 0:
                del self.staged[worker]
            else:
                self.staged[worker] = (left_s, left_b)
        req.assigned_s = 0.0
