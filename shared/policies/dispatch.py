"""BubbleTea's dispatch policy (pure): open bubbles, queued requests, batches in flight, and what
goes where. Every entry point takes `now` and returns a `Decisions` value (shared/policies/decisions.py).

The `dispatcher` service is a thin shell: it feeds this object bubble events, new requests, workers'
reports and a timer, then executes the decisions (send batches, fail requests, ack finished ones)
and logs each one's why. The simulator feeds it the same inputs from a virtual clock.

* A request waits in the queue until some open bubble has room for (part of) it; packing is
  `shared.policies.packing.pack` with the learned `PrefillCostModel`.
* Dispatch happens at bubble start, and whenever a request arrives (or a report frees a request)
  while a bubble is open; a bubble's budget shrinks by what was already sent into it.
* A request is never in two bubbles at once; a worker's report moves it on (to the layer it
  reached) or out (answered); what a worker could not finish is queued again at its resume point.
* A bubble's budget counts only work still outstanding there: a reported batch gives back its
  predicted time, so a worker that finishes early is topped up from the same bubble.
* **Staging**: when a bubble ends, the next one's first batch is sent at once and the worker holds
  it until a bubble long enough to use it starts (the fill policy decides that on the worker). A
  bubble then starts filling without waiting for a round trip through the bus; the dispatcher tops
  it up once the bubble's own start event arrives. The staged batch is sized for the median of the
  worker's recent bubbles, capped at `stage_s` (requests held on an idle worker are not available
  to open bubbles elsewhere). Only workers with a bubble in the last `STAGE_WINDOW_S` get staged work.
* **Keeping ahead**: while a bubble is open, at least `ahead_s` of work stays outstanding on its
  worker, also past the bubble's predicted budget. `ahead_s = 0` (the default) keeps strictly to
  the budget: measured on 2 shared cores, keeping 8 ms ahead slowed training without raising the fill.
* Packing uses the cost model's mean prediction: a misprediction costs at most one layer's time,
  because the worker yields at the next layer boundary when training input arrives.
* **Admission** (`Admission`): a request that arrives behind more queued prefill than the bubbles
  serve before its deadline is refused at once (`FailureReason.OVERLOADED`, a 429 with
  Retry-After), not left to expire in the queue: past capacity the excess is turned away early
  and what is admitted is served in time. The bubbles' rate is learned from the bubbles announced
  over the last `RATE_WINDOW_S`; until that long has been seen, every request is admitted.
* **Deadlines**: a request past its deadline that is not running in an open bubble is failed
  (`FailureReason.DEADLINE`); one a worker still runs finishes first.
* **Nothing can serve** (`fail_waiting`, when the readiness gate of `readiness.py` says training
  finished, stopped or stalled): every request not running in an open bubble is failed at once
  (`FailureReason.UNAVAILABLE`) instead of waiting for its deadline.
* **Lost batches**: a batch with no report `BATCH_GRACE_S` after it should have ended (its
  predicted time, plus the hold time of a staged batch) was lost with its worker: its requests queue
  again at their last reported layer, and the worker's bubble is closed so nothing more goes there
  (if the worker is alive after all, its next bubble start opens a bubble again). Such a worker
  may still run the batch (first answer wins); its report changes nothing, and in particular
  spends no saved partial state: only an accepted report does (`Spent`), so the batch that
  replaced it still finds the state it resumes from.

**Cost at scale** (the simulator runs this for thousands of workers): a trigger visits only the open
bubbles that may still take work and the idle workers that may take staged work, each kept in the
order a full scan visits them (bubbles by start, ties in the order they opened; workers by name);
packing reads the head of a queue kept in packing order (`packing.WaitingQueue`), never sorting it.
A bubble or worker leaves its index only for a reason that lasts (no time left, something staged,
out of the staging window; a bubble's time left never grows until a report gives some back) and is
put back by whatever undoes it; a bubble whose time left did not hold a layer of the queue's head
is set aside until a head that needs less, or does not fit its memory, comes (`dispatch_index.RoomIndex`). The
decisions are exactly those of visiting everything (tests/unit/test_dispatch.py checks this on long
random input sequences); time going backwards (a clock step) rebuilds the indexes.

One state machine over the same tables (requests, bubbles, staged work, batches in flight), in
three files: its inputs and tables in `dispatch_inputs.py`; this module, which takes the events
(requests, bubbles, reports, the timer) and keeps the queue; and `dispatch_fill.py` (`Filling`,
mixed into `DispatchState`), which packs the queue into bubbles and staged batches and keeps the
room indexes. The values it returns live in `decisions.py`, packing and the ordered queue in
`packing.py`, the bubble index in `dispatch_index.py`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.control.status import FailureReason
from shared.policies.admission import Admission
from shared.policies.decisions import (
    Decisions,
    Failure,
    Finished,
    Ignored,
    LostBatch,
    Spent,
    Trigger,
)
from shared.policies.dispatch_fill import Filling
from shared.policies.dispatch_index import BubbleKey, RoomIndex, add_sorted
from shared.policies.dispatch_inputs import BATCH_GRACE_S as BATCH_GRACE_S
from shared.policies.dispatch_inputs import RATE_WINDOW_S as RATE_WINDOW_S
from shared.policies.dispatch_inputs import RECENT_BUBBLES as RECENT_BUBBLES
from shared.policies.dispatch_inputs import STAGE_WINDOW_S as STAGE_WINDOW_S
from shared.policies.dispatch_inputs import STALE_BUBBLE_S as STALE_BUBBLE_S
from shared.policies.dispatch_inputs import TICK_S as TICK_S
from shared.policies.dispatch_inputs import Bubble as Bubble
from shared.policies.dispatch_inputs import BubbleOpened as BubbleOpened
from shared.policies.dispatch_inputs import Counts as Counts
from shared.policies.dispatch_inputs import InFlight as InFlight
from shared.policies.dispatch_inputs import Progress as Progress
from shared.policies.dispatch_inputs import Request as Request
from shared.policies.dispatch_inputs import WorkerReady as WorkerReady
from shared.policies.fill import HOLD_STAGED_S
from shared.policies.packing import (
    WaitingQueue,
    budget,
)
from shared.policies.prefill_cost import PrefillCostModel
from shared.spec.config import BubbleTea


@dataclass
class DispatchState(Filling):
    layers: int
    guard_s: float
    overhead_s: float
    max_batch: int
    order: str = "deadline"
    cost: PrefillCostModel = field(default_factory=PrefillCostModel)
    stage_next: bool = True
    stage_s: float = 1.0  # at most this much work staged for a worker's next bubble
    hold_s: float = HOLD_STAGED_S  # how long the worker keeps it for that bubble (then hands it back)
    ahead_s: float = 0.0  # work kept outstanding in an open bubble beyond its budget
    enabled: bool = True  # BubbleTea off: bubbles are ignored, requests wait for their deadlines
    batch_prefix: str = "b"  # batch ids are <prefix>-<n>: unique per dispatcher incarnation
    #: One device second lasts this many real seconds: the windows above (`STAGE_WINDOW_S`, ...)
    #: are stretched by it; the durations given as arguments come stretched already (a scaled spec).
    time_scale: float = 1.0
    #: the windows in real seconds (set from the constants and `time_scale`)
    stage_window_s: float = field(default=STAGE_WINDOW_S, init=False)
    batch_grace_s: float = field(default=BATCH_GRACE_S, init=False)
    stale_bubble_s: float = field(default=STALE_BUBBLE_S, init=False)
    requests: dict[str, Request] = field(default_factory=dict)
    bubbles: dict[str, Bubble] = field(default_factory=dict)
    #: per worker: predicted seconds (and KV bytes) of the batch staged for its next bubble
    staged: dict[str, tuple[float, int]] = field(default_factory=dict)
    recent: dict[str, deque[float]] = field(default_factory=dict)
    free_memory: dict[str, int] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)  # the worker's last bubble event
    addresses: dict[str, str] = field(default_factory=dict)
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    # Indexes that make a trigger cost what it changes, not the cluster's size (see the module's
    # docstring); the decisions do not depend on them.
    #: requests with `in_bubble is None` (queued, not on any worker): nothing to pack costs O(1)
    _waiting: int = field(default=0, init=False, repr=False)
    #: their predicted seconds, as each was counted when it joined the queue (for admission)
    _queued_s: float = field(default=0.0, init=False, repr=False)
    _admission: Admission = field(init=False, repr=False)
    #: the waiting requests in packing order
    _queue: WaitingQueue = field(init=False, repr=False)
    #: every open bubble's place in the visiting order: (started, opened rank, worker)
    _bubble_key: dict[str, BubbleKey] = field(default_factory=dict, init=False, repr=False)
    #: the open bubbles that may still take work, in visiting order
    _room: RoomIndex = field(init=False, repr=False)
    #: the workers that may take staged work, by name
    _idle: list[str] = field(default_factory=list, init=False, repr=False)
    _opened: int = field(default=0, init=False, repr=False)  # bubbles opened so far (their rank)
    _clock: float = field(default=-math.inf, init=False, repr=False)  # the latest `now` of a full visit

    def __post_init__(self) -> None:
        self._queue = WaitingQueue(self.order)
        self._room = RoomIndex()
        k = self.time_scale
        self.stage_window_s, self.batch_grace_s = STAGE_WINDOW_S * k, BATCH_GRACE_S * k
        self.stale_bubble_s = STALE_BUBBLE_S * k
        self._admission = Admission(RATE_WINDOW_S * k)

    @classmethod
    def from_spec(
        cls, bt: BubbleTea, layers: int, *, time_scale: float = 1.0, batch_prefix: str = "b"
    ) -> DispatchState:
        """The state a dispatcher (or the simulator) runs for the spec's `bubbletea` section
        (already scaled by `time_scale`) serving a model of `layers` blocks."""
        return cls(
            layers=layers,
            guard_s=bt.guard_ms / 1000,
            overhead_s=bt.dispatch_overhead_ms / 1000,
            max_batch=bt.max_batch_requests,
            order=bt.order,
            cost=PrefillCostModel.scaled(time_scale),
            stage_next=bt.stage_ms > 0,
            stage_s=bt.stage_ms / 1000,
            hold_s=bt.hold_ms / 1000,
            ahead_s=bt.keep_ahead_ms / 1000,
            enabled=bt.enabled,
            batch_prefix=batch_prefix,
            time_scale=time_scale,
        )

    @property
    def tick_s(self) -> float:
        """How often the service should call `tick` (real s)."""
        return TICK_S * self.time_scale

    def work_for(self, worker: str) -> bool:
        """Whether a bubble of `worker` opening now has work to take: requests wait in the queue,
        or a batch is staged there (what the run's figures count a bubble 'with work' by)."""
        return self._waiting > 0 or worker in self.staged

    # --- inputs ----------------------------------------------------------------------------

    def add_request(self, req: Request, now: float) -> Decisions:
        if req.id in self.requests:  # a redelivered request is already known
            return Decisions(ignored=(Ignored(f"request {req.id}", "already queued or running"),))
        if self.enabled and req.in_bubble is None and req.next_layer == 0:
            why = self._admission.refusal(self._queued_s, self._remaining_s(req), req.deadline, now)
            if why is not None:
                self.counts.overloaded += 1
                return Decisions(failed=(Failure(req.id, req.ticket, req.payload, FailureReason.OVERLOADED, why),))
        self.requests[req.id] = req
        self._queue.know(req.id, req.deadline, req.arrival)
        if req.in_bubble is None:
            self._enqueue(req)
        self.counts.requests += 1
        return self._fill_all(now, Trigger.REQUEST)

    def bubble_start(self, b: BubbleOpened, now: float) -> Decisions:
        if not self.enabled:
            return Decisions(ignored=(Ignored(f"bubble of {b.worker}", "BubbleTea is disabled in the spec"),))
        if now - b.started > self.stale_bubble_s:
            why = f"started {now - b.started:.1f}s ago: history (read from the backlog after a restart)"
            return Decisions(ignored=(Ignored(f"bubble of {b.worker}", why),))
        staged_s, staged_bytes = self.staged.pop(b.worker, (0.0, 0))
        old = self._bubble_key.get(b.worker)
        if old is not None:  # replaced: it keeps its place in `self.bubbles`, so its rank
            self._room.remove(old)
        self._opened += 1
        key = (b.started, old[1] if old is not None else self._opened, b.worker)
        self._bubble_key[b.worker] = key
        self._room.add(key)
        self.bubbles[b.worker] = Bubble(
            b.worker, b.started, b.predicted_s, b.free_memory, sent_s=staged_s, sent_bytes=staged_bytes, tag=b.tag
        )
        self.recent.setdefault(b.worker, deque(maxlen=RECENT_BUBBLES)).append(b.predicted_s)
        self._admission.bubble(b.started, budget(b.predicted_s, 0.0, self.guard_s, self.overhead_s))
        self.free_memory[b.worker] = b.free_memory
        self.last_seen[b.worker] = now
        self.addresses[b.worker] = b.address
        return self._fill(b.worker, now, Trigger.BUBBLE_START)

    def bubble_end(self, worker: str, tag: object = None, *, now: float) -> Decisions:
        """Training input arrived: send nothing more there (what runs stops at a layer boundary).
        With a `tag`, only the bubble it names is closed (an end that overtook the next start is
        ignored). The worker's next bubble gets its staged batch now."""
        b = self.bubbles.get(worker)
        if b is not None and (tag is None or b.tag == tag):
            self._close(worker)
        self.last_seen[worker] = now
        add_sorted(self._idle, worker)
        return self._stage(worker, now, Trigger.BUBBLE_END)

    def worker_joined(self, j: WorkerReady, now: float) -> Decisions:
        """A worker set up and entered the run: it is in no bubble, and its first may open at once.
        Its first batch is staged there now, sized for the typical bubble it announced (unless it
        has bubbles on record, a worker rejoining after a recovery): so that bubble, too, starts
        without a round trip through the bus."""
        if not self.enabled:
            return Decisions(ignored=(Ignored(f"worker {j.worker}", "BubbleTea is disabled in the spec"),))
        if now - j.at > self.stale_bubble_s:
            why = f"joined {now - j.at:.1f}s ago: history (read from the backlog after a restart)"
            return Decisions(ignored=(Ignored(f"worker {j.worker}", why),))
        if j.worker in self.bubbles:  # a bubble of its previous life, whose end never came
            self._close(j.worker)
        if not self.recent.get(j.worker) and j.typical_s > 0:
            self.recent[j.worker] = deque([j.typical_s], maxlen=RECENT_BUBBLES)
        self.free_memory[j.worker] = j.free_memory
        self.last_seen[j.worker] = now
        self.addresses[j.worker] = j.address
        add_sorted(self._idle, j.worker)
        return self._stage(j.worker, now, Trigger.JOINED)

    def report(self, batch_id: str, worker: str, progress: list[Progress], now: float) -> Decisions:
        """A worker finished (or was preempted in, or handed back) a batch."""
        if self.in_flight.pop(batch_id, None) is None:
            # Sent by a previous dispatcher, or already requeued as lost: its requests are being
            # handled afresh, and anything it answered stays answered (first answer wins).
            return Decisions(ignored=(Ignored(f"report of batch {batch_id}", "not in flight"),))
        finished: list[Finished] = []
        spent: list[Spent] = []
        for p in progress:
            req = self.requests.get(p.id)
            if req is None or req.in_bubble != worker:
                continue  # stale or duplicate
            ran = p.reached_layer - req.next_layer
            if ran > 0 and p.seconds > 0:  # finished or preempted: every run teaches the model
                self.cost.observe(req.tokens, p.seconds * self.layers / ran)  # scale to a whole prompt
            self._give_back(worker, req)
            if req.next_layer > 0 and (p.finished or ran > 0):  # it resumed from a saved state, now used up
                spent.append(Spent(req.id, req.next_layer))
            req.next_layer, req.in_bubble = max(req.next_layer, p.reached_layer), None
            if p.finished or req.next_layer >= self.layers:
                finished.append(Finished(req.id, req.ticket))
                del self.requests[p.id]
                self._queue.forget(p.id)
            else:
                self._enqueue(req)
        self.counts.done += len(finished)
        return Decisions(finished=tuple(finished), spent=tuple(spent)) + self._fill_all(now, Trigger.REPORT)

    def tick(self, now: float) -> Decisions:
        """The timer: fail requests past their deadline, requeue batches that never reported."""
        failed = self._expire(now)
        lost: list[LostBatch] = []
        for batch_id, b in list(self.in_flight.items()):
            if batch_id in self.in_flight and b.report_by < now:
                lost += self._worker_lost(b.worker, now)
        out = Decisions(failed=failed, lost=tuple(lost))
        return out + self._fill_all(now, Trigger.TICK) if lost else out

    def fail_waiting(self, why: str, now: float) -> Decisions:
        """Nothing can serve (the readiness gate says so): fail every request not running in an
        open bubble now, with `why`. One that runs finishes (or is failed once it is handed back)."""
        gone = self._not_running()
        self.counts.unavailable += len(gone)
        return Decisions(failed=self._drop(gone, FailureReason.UNAVAILABLE, lambda r: why))

    def info(self) -> dict[str, object]:
        """Counters for the service's heartbeat and progress log."""
        running = sum(1 for r in self.requests.values() if r.in_bubble is not None)
        return {
            "queued": len(self.requests) - running,
            "running": running,
            "open_bubbles": len(self.bubbles),
            "batches_in_flight": len(self.in_flight),
            **vars(self.counts),
        }

    # --- decisions -------------------------------------------------------------------------

    def _expire(self, now: float) -> tuple[Failure, ...]:
        gone = [r for r in self._not_running() if r.deadline is not None and r.deadline < now]
        self.counts.expired += len(gone)
        detail = "deadline passed after {:.1f}s in the queue: no pipeline bubble had room for it"
        return self._drop(gone, FailureReason.DEADLINE, lambda r: detail.format(now - r.arrival))

    def _not_running(self) -> list[Request]:
        """Requests not running in an open bubble now: queued, or staged on an idle worker."""
        return [r for r in self.requests.values() if r.in_bubble is None or r.in_bubble not in self.bubbles]

    def _drop(
        self, gone: list[Request], reason: FailureReason, detail: Callable[[Request], str]
    ) -> tuple[Failure, ...]:
        for r in gone:
            if r.in_bubble is not None:  # staged on a worker: no longer counts there
                self._give_back(r.in_bubble, r)
            else:
                self._dequeued(r)
            del self.requests[r.id]
            self._queue.forget(r.id)
        return tuple(Failure(r.id, r.ticket, r.payload, reason, detail(r)) for r in gone)

    def _worker_lost(self, worker: str, now: float) -> list[LostBatch]:
        """A batch of `worker` never reported back: the worker is presumed dead. All its batches in
        flight are lost, their requests queue again at their last reported layer, and its bubble
        closes with nothing staged there; it opens again on the worker's next bubble start."""
        lost = []
        for batch_id, b in list(self.in_flight.items()):
            if b.worker != worker:
                continue
            del self.in_flight[batch_id]
            back = [r for r in (self.requests.get(i) for i in b.ids) if r is not None and r.in_bubble == worker]
            for r in back:
                r.in_bubble, r.assigned_s = None, 0.0
                self._enqueue(r)
            self.counts.requeued += len(back)
            lost.append(LostBatch(batch_id, worker, len(back), now - b.report_by))
        if worker in self.bubbles:
            self._close(worker)
        self.staged.pop(worker, None)
        self.recent.pop(worker, None)
        return lost

    def _remaining_s(self, req: Request) -> float:
        """The predicted seconds of what `req` has left to run."""
        return self.cost.predict(req.tokens) * (self.layers - req.next_layer) / self.layers

    def _enqueue(self, req: Request) -> None:
        """`req` waits in the queue (again)."""
        self._queue.put(req.id)
        self._waiting += 1
        req.queued_s = self._remaining_s(req)
        self._queued_s += req.queued_s

    def _dequeued(self, req: Request) -> None:
        """`req` left the queue (sent to a worker, or failed); the queue's own `take`/`forget` is
        the caller's."""
        self._waiting -= 1
        self._queued_s = max(0.0, self._queued_s - req.queued_s) if self._waiting else 0.0
        req.queued_s = 0.0
