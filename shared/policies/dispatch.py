"""BubbleTea's dispatch policy (pure): the waiting requests, the work queued on each worker (its
credit), batches in flight, and what goes where. Every entry point takes `now` and returns a
`Decisions` value (shared/policies/decisions.py).

The `dispatcher` service is a thin shell: it feeds this object requests, bubble starts and ends,
workers' reports and a timer, then executes the decisions (send batches, fail requests, ack
finished ones) and logs each one's why. The simulator feeds it the same inputs from a virtual clock.

* **Work waits on the worker, not the worker on work.** Every worker holds about
  `credit_bubbles` (1.5) of its typical bubble (the mean of its recent ones, at most
  `max_credit_s`) of predicted prefill, queued ahead of its bubbles whether or not one is open: its
  **credit**. A bubble then starts with its work already there, and runs it until training input
  arrives (`shared.policies.fill`). While a bubble is open its worker may hold that bubble's
  predicted length more.
* **What a worker holds, the dispatcher knows.** A batch counts against its worker's credit from
  the moment it is sent until the worker says it is used: the end of the bubble it finished in
  (`bubble_end`'s `finished`, the fast path), its report (finished, preempted past hope, or handed
  back), or its loss. The worker's own queue is the same set of batches, less those still on
  their way to it and those whose use is on its way back (tests/unit/test_credit_agreement.py).
* **Requests go where there is room.** Whenever requests wait and a worker has room (credit to
  spare: a bubble's start or end, a report, a request arriving, a worker joining), the roomiest
  worker takes a batch of whole requests (at most half its window, so a finished batch is topped
  up while the next one runs), then the next roomiest, until nothing waits or nobody has room.
  Packing is `shared.policies.packing.pack_ordered` with the learned `PrefillCostModel`. Only
  workers with a bubble event in the last `STAGE_WINDOW_S` get credit.
* **A request is never on two workers at once**; a worker's report moves it on (to the layer it
  reached) or out (answered); what a worker could not finish is queued again at its resume point.
  Its saved state stays with the worker that saved it, so for `RESUME_WAIT_S` it waits for a
  worker of that datacenter (a worker elsewhere would compute it again from its prompt).
* **Admission** (`Admission`): a request that arrives behind more prefill than the bubbles serve
  before its deadline (the queue's and all the work held on workers) is refused at once
  (`FailureReason.OVERLOADED`, a 429 with Retry-After), not left to expire in the queue.
* **Deadlines**: a request past its deadline that is not running in an open bubble is failed
  (`FailureReason.DEADLINE`); one a worker still runs finishes first. One queued on a worker
  carries when it is due (`PrefillItem.due`, its objective or deadline): the worker that comes to
  it later fails it (`DEADLINE`) rather than answer it late.
* **Nothing can serve** (`fail_waiting`, when the readiness gate of `readiness.py` says training
  finished, stopped or stalled): every request not running in an open bubble is failed at once
  (`FailureReason.UNAVAILABLE`) instead of waiting for its deadline.
* **Lost batches**: a batch with no report `BATCH_GRACE_S` after it could last have run (sent,
  plus the time a worker may hold it, plus the work it held ahead of it, plus its predicted time)
  was lost with its worker, unless the worker was heard from within that grace (then it is waited
  for once more); lost: all of that worker's batches are, their requests queue again at their
  last reported layer, and it gets no credit until its next bubble event. Such a worker may
  still run the batch (first answer wins); its report changes nothing, and in particular spends
  no saved partial state: only an accepted report does (`Spent`), so the batch that replaced it
  still finds the state it resumes from.
* **Stuck bubbles**: one open `STUCK_BUBBLE_FACTOR` times its expected length is taken as closed
  (its worker died in it), so its requests stop counting as running and move or fail at their
  objective (`OpenBubbles`).

**A worker whose prefill fails** batch after batch stops taking it (`shared.policies.guest`) and
says so (`worker_off`): it gets no credit until a new process joins in its slot. **Taking over** a
run, a dispatcher counts the batches its predecessors sent that the workers still hold (`adopt`).

**Cost at scale**: a trigger visits only the workers with room (`dispatch_index.CreditIndex`) and
packing reads the head of a queue kept in packing order (`packing.WaitingQueue`). One state machine
in three files: inputs and tables (`dispatch_inputs.py`), events and the queue (here), credit and
packing (`dispatch_fill.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.config.spec import BubbleTea
from shared.policies.admission import BEST_HALF_LIFE_S, Admission
from shared.policies.decisions import Decisions, Finished, Ignored, LostBatch, Spent, Trigger
from shared.policies.dispatch_fill import Filling
from shared.policies.dispatch_index import CreditIndex, OpenBubbles
from shared.policies.dispatch_inputs import BATCH_GRACE_S as BATCH_GRACE_S
from shared.policies.dispatch_inputs import RATE_WINDOW_S as RATE_WINDOW_S
from shared.policies.dispatch_inputs import RECENT_BUBBLES as RECENT_BUBBLES
from shared.policies.dispatch_inputs import RESUME_WAIT_S as RESUME_WAIT_S
from shared.policies.dispatch_inputs import STAGE_WINDOW_S as STAGE_WINDOW_S
from shared.policies.dispatch_inputs import STALE_BUBBLE_S as STALE_BUBBLE_S
from shared.policies.dispatch_inputs import TICK_S as TICK_S
from shared.policies.dispatch_inputs import Bubble as Bubble
from shared.policies.dispatch_inputs import BubbleClosed as BubbleClosed
from shared.policies.dispatch_inputs import BubbleOpened as BubbleOpened
from shared.policies.dispatch_inputs import Counts as Counts
from shared.policies.dispatch_inputs import Credit as Credit
from shared.policies.dispatch_inputs import InFlight as InFlight
from shared.policies.dispatch_inputs import Progress as Progress
from shared.policies.dispatch_inputs import Request as Request
from shared.policies.dispatch_inputs import WorkerReady as WorkerReady
from shared.policies.dispatch_leaving import Leaving
from shared.policies.fill import HOLD_STAGED_S
from shared.policies.packing import WaitingQueue
from shared.policies.prefill_cost import PrefillCostModel
from shared.wire.status import FailureReason


@dataclass
class DispatchState(Filling, Leaving):
    layers: int
    max_batch: int = 32
    order: str = "deadline"
    cost: PrefillCostModel = field(default_factory=PrefillCostModel)
    credit_bubbles: float = 1.5  # work held on a worker, in its typical bubbles
    max_credit_s: float = 1.0  # at most this much work held on one worker
    hold_s: float = HOLD_STAGED_S  # how long a worker may keep work no bubble took (then hands it back)
    enabled: bool = True  # BubbleTea off: bubbles are ignored, requests wait for their deadlines
    batch_prefix: str = "b"  # batch ids are <prefix>-<n>: unique per dispatcher incarnation
    #: One device second lasts this many real seconds: the windows above (`STAGE_WINDOW_S`, ...)
    #: are stretched by it; the durations given as arguments come stretched already (a scaled spec).
    time_scale: float = 1.0
    #: the windows in real seconds (set from the constants and `time_scale`)
    stage_window_s: float = field(default=STAGE_WINDOW_S, init=False)
    batch_grace_s: float = field(default=BATCH_GRACE_S, init=False)
    stale_bubble_s: float = field(default=STALE_BUBBLE_S, init=False)
    resume_wait_s: float = field(default=RESUME_WAIT_S, init=False)
    requests: dict[str, Request] = field(default_factory=dict)
    workers: dict[str, Credit] = field(default_factory=dict)
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    # Running totals and an index that make a trigger cost what it changes, not the cluster's
    # size (see the module's docstring); the decisions do not depend on them.
    #: requests with `on_worker is None` (waiting here): nothing to pack costs O(1)
    _waiting: int = field(default=0, init=False, repr=False)
    #: their predicted seconds, as each was counted when it joined the queue (for admission)
    _queued_s: float = field(default=0.0, init=False, repr=False)
    #: the credit in use on every worker, summed, and its batches (for admission)
    _held_s: float = field(default=0.0, init=False, repr=False)
    _held_n: int = field(default=0, init=False, repr=False)
    _admission: Admission = field(init=False, repr=False)
    #: the waiting requests in packing order
    _queue: WaitingQueue = field(init=False, repr=False)
    #: the workers with room, roomiest first
    _index: CreditIndex = field(init=False, repr=False)
    #: when each open bubble is taken as closed, soonest first
    _open: OpenBubbles = field(init=False, repr=False)
    _clock: float = field(default=-math.inf, init=False, repr=False)  # the latest `now` of a fill
    #: a fresh bubble start was seen (training runs): before it, no objective can be promised
    _bubble_seen: bool = field(default=False, init=False, repr=False)
    #: requests in batches an earlier dispatcher sent, that their workers hold (`adopt`): -> (worker, layer)
    _adopted: dict[str, tuple[str, int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._queue = WaitingQueue(self.order)
        self._index = CreditIndex()
        self._open = OpenBubbles()
        k = self.time_scale
        self.stage_window_s, self.batch_grace_s = STAGE_WINDOW_S * k, BATCH_GRACE_S * k
        self.stale_bubble_s, self.resume_wait_s = STALE_BUBBLE_S * k, RESUME_WAIT_S * k
        self._admission = Admission(RATE_WINDOW_S * k, BEST_HALF_LIFE_S * k)

    @classmethod
    def from_spec(
        cls, bt: BubbleTea, layers: int, *, time_scale: float = 1.0, batch_prefix: str = "b"
    ) -> DispatchState:
        """The state a dispatcher (or the simulator) runs for the spec's `bubbletea` section
        (already scaled by `time_scale`) serving a model of `layers` blocks."""
        return cls(
            layers=layers,
            max_batch=bt.max_batch_requests,
            order=bt.order,
            cost=PrefillCostModel.scaled(time_scale),
            credit_bubbles=bt.credit_bubbles,
            max_credit_s=bt.max_credit_ms / 1000,
            hold_s=bt.hold_ms / 1000,
            enabled=bt.enabled,
            batch_prefix=batch_prefix,
            time_scale=time_scale,
        )

    @property
    def tick_s(self) -> float:
        """How often the service should call `tick` (real s)."""
        return TICK_S * self.time_scale

    def came_round(self, now: float) -> bool:
        """Whether the bubbles' rate is measured (`Admission.came_round`): until then a request with
        a TTFT objective is moved to the decoder, or refused (`prompt_placement.on_arrival`)."""
        return self._admission.came_round(now)

    def work_for(self, worker: str) -> bool:
        """Whether a bubble of `worker` opening now has work to take, as far as the dispatcher
        knows: requests wait here, or work is held there."""
        c = self.workers.get(worker)
        return self._waiting > 0 or (c is not None and c.held_s > 0)

    @property
    def recomputed_share(self) -> float | None:
        """Of the prompt layers workers ran, the share run again because the partial state they
        would have resumed from was in another datacenter or lost (None before any ran)."""
        run = self.counts.layers_run
        return self.counts.layers_recomputed / run if run else None

    # --- inputs ----------------------------------------------------------------------------

    def add_request(self, req: Request, now: float) -> Decisions:
        return self.add_requests((req,), now)  # one at a time: the simulator and tests

    def add_requests(self, reqs: Iterable[Request], now: float) -> Decisions:
        """Requests arriving together (one read of the stream): each admitted or refused in turn,
        then one pass puts the admitted where there is room."""
        failed, ignored = [], []
        for req in reqs:
            if req.id in self.requests:  # a redelivered request is already known
                ignored.append(Ignored(f"request {req.id}", "already queued or running"))
                continue
            if (held := self._adopted.pop(req.id, None)) is not None:  # already on a worker (`adopt`)
                req.on_worker, req.next_layer = held
            if self.enabled and req.on_worker is None and req.next_layer == 0:
                turned = self._placed_elsewhere(req, now)  # refused, or moved to the decoder
                if turned is not None:
                    failed.append(turned)
                    continue
            self.requests[req.id] = req
            self._queue.know(req.id, req.deadline, req.arrival)
            if req.on_worker is None:
                self._enqueue(req)
            self.counts.requests += 1
        return Decisions(failed=tuple(failed), ignored=tuple(ignored)) + self._fill_all(now, Trigger.REQUEST)

    def bubble_start(self, b: BubbleOpened, now: float) -> Decisions:
        if not self.enabled:
            return Decisions(ignored=(Ignored(f"bubble of {b.worker}", "BubbleTea is disabled in the spec"),))
        if now - b.started > self.stale_bubble_s:
            why = f"started {now - b.started:.1f}s ago: history (read from the backlog after a restart)"
            return Decisions(ignored=(Ignored(f"bubble of {b.worker}", why),))
        c = self._seen(b.worker, b.address, b.dc, b.free_memory, now)
        c.bubble = Bubble(b.started, b.predicted_s, b.tag)
        self._open.opened(c.worker, c.bubble, b.predicted_s or c.typical_s(), self.stage_window_s)
        self._bubble_seen = True
        self._reindex(c)
        return self._fill_all(now, Trigger.BUBBLE_START)

    def bubble_end(self, e: BubbleClosed, now: float) -> Decisions:
        """Training input arrived: the bubble is over (what runs stops at a layer boundary). Its
        length joins the worker's typical bubble; the batches that finished in it give their
        credit back now. With a `tag`, only the bubble it names is closed (an end that overtook
        the next start leaves that one open)."""
        if not self.enabled:
            return Decisions()
        c = self.workers.get(e.worker)
        if c is None:
            return Decisions(ignored=(Ignored(f"bubble end of {e.worker}", "no bubble or batch of it known"),))
        if c.bubble is not None and (e.tag is None or c.bubble.tag == e.tag):
            if e.actual_s is not None:  # what it offered prefill: the rest the fit rule refused is not
                self._admission.bubble(c.bubble.started, max(0.0, e.actual_s - e.refused_s), e.worker, c.bubble.tag)
            c.bubble = None
        if e.actual_s is not None:
            c.lengths.append(e.actual_s)
        for batch_id in e.finished:
            self._release(c, batch_id)
        c.last_seen = now
        self._reindex(c)
        return self._fill_all(now, Trigger.BUBBLE_END)

    def worker_joined(self, j: WorkerReady, now: float) -> Decisions:
        """A worker set up and entered the run: it is in no bubble, and its first may open at once.
        It gets its first credit now, sized by the typical bubble it announced (unless it has
        bubbles on record: a worker rejoining after a recovery), so that bubble, too, starts with
        its work already there."""
        if not self.enabled:
            return Decisions(ignored=(Ignored(f"worker {j.worker}", "BubbleTea is disabled in the spec"),))
        if now - j.at > self.stale_bubble_s:
            why = f"joined {now - j.at:.1f}s ago: history (read from the backlog after a restart)"
            return Decisions(ignored=(Ignored(f"worker {j.worker}", why),))
        c = self._seen(j.worker, j.address, j.dc, j.free_memory, now)
        c.bubble = None  # a bubble of its previous life, whose end never came
        c.off = None  # a new process in the slot: its guest starts afresh
        if not c.lengths and j.typical_s > 0:
            c.lengths.append(j.typical_s)
        self._reindex(c)
        return self._fill_all(now, Trigger.JOINED)

    def worker_off(self, worker: str, why: str, now: float) -> Decisions:
        """`worker` takes no more prefill: it is offered nothing until a new process joins in its
        slot. What it holds comes back with its reports (it hands it all back)."""
        c = self.workers.setdefault(worker, Credit(worker))
        c.off, c.bubble, c.last_seen = why, None, now
        self._reindex(c)
        return Decisions()

    def report(self, batch_id: str, worker: str, progress: list[Progress], now: float) -> Decisions:
        """A worker finished a batch, or handed it back (unrun, or part run)."""
        if (flight := self.in_flight.pop(batch_id, None)) is None:
            # Sent by a previous dispatcher, or already requeued as lost: its requests are being
            # handled afresh, and anything it answered stays answered (first answer wins).
            return Decisions(ignored=(Ignored(f"report of batch {batch_id}", "not in flight"),))
        for rid in flight.ids:  # an adopted batch's, reported before its request came back: it queues
            self._adopted.pop(rid, None)
        c = self.workers.get(worker)
        if c is not None:
            self._release(c, batch_id)
            self._reindex(c)
        finished: list[Finished] = []
        spent: list[Spent] = []
        for p in progress:
            req = self.requests.get(p.id)
            if req is None or req.on_worker != worker:
                continue  # stale or duplicate
            self._learn(req, p)
            moved = p.reached_layer > req.next_layer
            if req.next_layer > 0 and (p.finished or moved):  # the state it could resume from is used up
                spent.append(Spent(req.id, req.next_layer))
            if moved and not p.finished:  # its state is saved where it stopped, in this worker's DC
                req.state_dc = c.dc if c is not None else ""
                left = (req.deadline - now) / 2 if req.deadline is not None else math.inf
                req.own_dc_until = now + max(0.0, min(self.resume_wait_s, left))
            req.next_layer, req.on_worker = max(req.next_layer, p.reached_layer), None
            if p.finished or req.next_layer >= self.layers:
                self._waited(req, p.answered_at if p.answered_at is not None else now)
                finished.append(Finished(req.id, req.ticket))
                del self.requests[p.id]
                self._queue.forget(p.id)
            else:
                self._enqueue(req)
        self.counts.done += len(finished)
        return Decisions(finished=tuple(finished), spent=tuple(spent)) + self._fill_all(now, Trigger.REPORT)

    def tick(self, now: float) -> Decisions:
        """The timer: close bubbles open far past their prediction, fail requests past their
        deadline, requeue batches that never reported (unless their worker is still heard from)."""
        ignored = self._open.close_stuck(now, self.workers, self._reindex)  # a worker died in its bubble
        failed = self._expire(now)
        lost: list[LostBatch] = []
        for batch_id, b in list(self.in_flight.items()):
            if batch_id in self.in_flight and b.report_by < now:
                c = self.workers.get(b.worker)
                if not b.extended and c is not None and now - c.last_seen <= self.batch_grace_s:  # alive
                    b.extended, b.report_by = True, now + self.hold_s + c.held_s + self.batch_grace_s  # once more
                    ignored.append(Ignored(f"batch {batch_id}", f"late; worker heard {now - c.last_seen:.3f}s ago"))
                    continue
                lost += self._worker_lost(b.worker, now)
        out = Decisions(failed=failed, lost=tuple(lost), ignored=tuple(ignored))
        return out + self._fill_all(now, Trigger.TICK) if lost else out

    def fail_waiting(self, why: str, now: float) -> Decisions:
        """Nothing can serve (the readiness gate says so): fail every request not running in an
        open bubble now, with `why`. One that runs finishes (or is failed once it is handed back)."""
        gone = self._not_running()
        self.counts.unavailable += len(gone)
        return Decisions(failed=self._drop(gone, FailureReason.UNAVAILABLE, lambda r: why))

    def info(self) -> dict[str, object]:
        """Counters for the service's heartbeat and progress log."""
        on_workers = sum(1 for r in self.requests.values() if r.on_worker is not None)
        return {
            "queued": len(self.requests) - on_workers,
            "on_workers": on_workers,
            "held_ms": round(self._held_s * 1000, 1),
            "open_bubbles": sum(1 for c in self.workers.values() if c.bubble is not None),
            "batches_in_flight": len(self.in_flight),
            **vars(self.counts),
        }

    # --- decisions -------------------------------------------------------------------------

    def _seen(self, worker: str, address: str, dc: str, free_memory: int, now: float) -> Credit:
        """The worker's record, refreshed from one of its events."""
        c = self.workers.get(worker)
        if c is None:
            c = self.workers[worker] = Credit(worker)
        c.address, c.free_memory, c.last_seen = address, free_memory, now
        c.dc = dc or c.dc
        return c

    def _learn(self, req: Request, p: Progress) -> None:
        """What a report teaches: the cost model (every run, scaled to a whole prompt) and the
        layers run, of them those run again (its state was in another DC, or lost)."""
        started = req.next_layer if p.started_layer is None else p.started_layer
        ran = p.reached_layer - started
        if ran <= 0:
            return
        if p.seconds > 0:
            self.cost.observe(req.tokens, p.seconds * self.layers / ran)
        self.counts.layers_run += ran
        self.counts.layers_recomputed += max(0, min(req.next_layer, p.reached_layer) - started)

    def _worker_lost(self, worker: str, now: float) -> list[LostBatch]:
        """A batch of `worker` never reported back: the worker is presumed dead. All its batches in
        flight are lost, their requests queue again at their last reported layer, and it gets no
        credit until its next bubble event."""
        lost = []
        for batch_id, b in list(self.in_flight.items()):
            if b.worker != worker:
                continue
            del self.in_flight[batch_id]
            for rid in b.ids:  # an adopted batch's request that has not come back yet: it queues when it does
                self._adopted.pop(rid, None)
            back = [r for r in (self.requests.get(i) for i in b.ids) if r is not None and r.on_worker == worker]
            for r in back:
                r.on_worker = None
                self._enqueue(r)
            self.counts.requeued += len(back)
            lost.append(LostBatch(batch_id, worker, len(back), now - b.report_by))
        c = self.workers.get(worker)
        if c is not None:
            for batch_id in list(c.held):
                self._release(c, batch_id)
            c.bubble = None
            c.lengths.clear()
            self._index.discard(worker)
        return lost
