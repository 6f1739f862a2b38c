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
* **Admission** (`Admission`): a request arriving behind more prefill than the bubbles serve before
  its deadline (the queue's and all the work held on workers) is refused at once (`OVERLOADED`, a
  429 with Retry-After), not left to expire in the queue; one a predecessor admitted is not judged twice.
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

**One object per invariant.** `DispatchState` composes a credit book (`credit_book.CreditBook`:
each worker's credit, the batches it holds, the index of the workers with room) and a waiting room
(`waiting_room.WaitingRoom`: every known request, the queue of those waiting); its entry points
feed them, a fill pass (`handout.Handout`) packs the room into the roomiest workers' credit, and
`refusals` says how a request leaves unanswered. Its inputs and tables are `dispatch_inputs.py`.
**Cost at scale**: a trigger visits only the workers with room (`dispatch_index.CreditIndex`) and
packing reads the head of a queue kept in packing order (`packing.WaitingQueue`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field
from typing import Generic

from shared.config.spec import BubbleTea
from shared.policies import refusals
from shared.policies.admission import BEST_HALF_LIFE_S, Admission
from shared.policies.credit_book import CreditBook
from shared.policies.dc_routing import DcSnapshot
from shared.policies.decisions import Decisions, Failure, Finished, Ignored, LostBatch, Moved, P, Spent, Trigger
from shared.policies.dispatch_inputs import (
    BATCH_GRACE_S,
    RATE_WINDOW_S,
    RESUME_WAIT_S,
    STAGE_WINDOW_S,
    STALE_BUBBLE_S,
    TICK_S,
    Adopted,
    Bubble,
    BubbleClosed,
    BubbleOpened,
    Counts,
    Credit,
    InFlight,
    Progress,
    Request,
    WorkerReady,
)
from shared.policies.fill import HOLD_STAGED_S
from shared.policies.handout import Handout
from shared.policies.prefill_cost import PrefillCostModel
from shared.policies.waiting_room import WaitingRoom


@dataclass
class DispatchState(Generic[P]):
    """The dispatcher's state machine: a credit book and a waiting room, fed by its entry points.
    `P` is what the caller attaches to each request (`Request.payload`)."""

    layers: int
    max_batch: int = 32
    order: str = "deadline"
    cost: PrefillCostModel = field(default_factory=PrefillCostModel)
    credit_bubbles: InitVar[float] = 1.5  # work held on a worker, in its typical bubbles
    max_credit_s: InitVar[float] = 1.0  # at most this much work held on one worker
    hold_s: InitVar[float] = HOLD_STAGED_S  # how long a worker may keep work no bubble took (then hands it back)
    enabled: bool = True  # BubbleTea off: bubbles are ignored, requests wait for their deadlines
    batch_prefix: str = "b"  # batch ids are <prefix>-<n>: unique per dispatcher incarnation
    #: One device second lasts this many real seconds: the windows above (`STAGE_WINDOW_S`, ...)
    #: are stretched by it; the durations given as arguments come stretched already (a scaled spec).
    time_scale: float = 1.0
    #: the windows in real seconds (set from the constants and `time_scale`)
    stale_bubble_s: float = field(default=STALE_BUBBLE_S, init=False)
    resume_wait_s: float = field(default=RESUME_WAIT_S, init=False)
    counts: Counts = field(default_factory=Counts)
    book: CreditBook = field(init=False, repr=False)
    room: WaitingRoom[P] = field(init=False, repr=False)
    handout: Handout[P] = field(init=False, repr=False)
    _admission: Admission = field(init=False, repr=False)
    #: a fresh bubble start was seen (training runs): before it, no objective can be promised
    _bubble_seen: bool = field(default=False, init=False, repr=False)

    def __post_init__(self, credit_bubbles: float, max_credit_s: float, hold_s: float) -> None:
        k = self.time_scale
        self.stale_bubble_s, self.resume_wait_s = STALE_BUBBLE_S * k, RESUME_WAIT_S * k
        self.book = CreditBook(
            credit_bubbles=credit_bubbles,
            max_credit_s=max_credit_s,
            hold_s=hold_s,
            stage_window_s=STAGE_WINDOW_S * k,
            batch_grace_s=BATCH_GRACE_S * k,
        )
        self.room = WaitingRoom(self.order, self.cost, self.layers)
        self.handout = Handout(
            self.room,
            self.book,
            layers=self.layers,
            cost=self.cost,
            max_batch=self.max_batch,
            batch_prefix=self.batch_prefix,
            counts=self.counts,
        )
        self._admission = Admission(RATE_WINDOW_S * k, BEST_HALF_LIFE_S * k)

    @classmethod
    def from_spec(
        cls, bt: BubbleTea, layers: int, *, time_scale: float = 1.0, batch_prefix: str = "b"
    ) -> DispatchState[P]:
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

    # --- views -----------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request[P]]:
        """Every known request, by id (the waiting room's)."""
        return self.room.requests

    @property
    def workers(self) -> dict[str, Credit]:
        """Every worker's record, by name (the credit book's)."""
        return self.book.workers

    @property
    def in_flight(self) -> dict[str, InFlight]:
        """The batches sent and not yet reported, by id (the credit book's)."""
        return self.book.in_flight

    @property
    def tick_s(self) -> float:
        """How often the service should call `tick` (real s)."""
        return TICK_S * self.time_scale

    def carry_admission(self, before: DispatchState[P] | DcSnapshot) -> None:
        """Start from what was measured of the bubbles (all of this process's last term's, or a
        predecessor's published rate: `Admission.seed`), not refusing objectives until they came round."""
        if not isinstance(before, DcSnapshot):
            self._admission, self._bubble_seen = before._admission, before._bubble_seen
        elif before.rate:
            self._admission.seed(before.rate, before.correction)
            self._bubble_seen = self._bubble_seen or before.started  # training ran: "not started" is wrong

    def came_round(self, now: float) -> bool:
        """Whether the bubbles' rate is measured (`Admission.came_round`): until then a request with
        a TTFT objective is moved to the decoder, or refused (`prompt_placement.on_arrival`)."""
        return self._admission.came_round(now)

    def snapshot(self, dc: str, ready: bool, now: float) -> DcSnapshot:  # for the front doors: `DcSnapshot.of`
        return DcSnapshot.of(dc, ready, self._admission, self.room.queued_s + self.book.held_s, self._bubble_seen, now)

    def work_for(self, worker: str) -> bool:
        """Whether a bubble of `worker` opening now has work to take, as far as the dispatcher
        knows: requests wait here, or work is held there."""
        c = self.book.workers.get(worker)
        return self.room.waiting > 0 or (c is not None and c.held_s > 0)

    @property
    def recomputed_share(self) -> float | None:
        """Of the prompt layers workers ran, the share run again because the partial state they
        would have resumed from was in another datacenter or lost (None before any ran)."""
        run = self.counts.layers_run
        return self.counts.layers_recomputed / run if run else None

    def info(self) -> dict[str, object]:
        """Counters for the service's heartbeat and progress log."""
        return {
            "queued": self.room.waiting,
            "on_workers": len(self.room.requests) - self.room.waiting,
            "held_ms": round(self.book.held_s * 1000, 1),
            "open_bubbles": sum(1 for c in self.book.workers.values() if c.bubble is not None),
            "batches_in_flight": len(self.book.in_flight),
            **vars(self.counts),
        }

    # --- inputs ----------------------------------------------------------------------------

    def add_request(self, req: Request[P], now: float) -> Decisions[P]:
        return self.add_requests((req,), now)  # one at a time: the simulator and tests

    def add_requests(self, reqs: Iterable[Request[P]], now: float) -> Decisions[P]:
        """Requests arriving together (one read of the stream): each admitted, refused or moved in
        turn, then one pass puts the admitted where there is room."""
        failed: list[Failure[P]] = []
        moved: list[Moved[P]] = []
        ignored: list[Ignored] = []
        for req in reqs:
            if req.id in self.room.requests:  # a redelivered request is already known
                ignored.append(Ignored(f"request {req.id}", "already queued or running"))
                continue
            if (held := self.book.claim(req.id)) is not None:  # already on a worker (`adopt`)
                req.on_worker, req.next_layer = held
            if self.enabled and req.on_worker is None and req.next_layer == 0 and not req.admitted:
                turned = refusals.on_arrival(req, self.room, self.book.held_s, self._admission, self._bubble_seen, now)
                if isinstance(turned, Moved):  # to the decoder
                    self.counts.moved += 1
                    moved.append(turned)
                    continue
                if turned is not None:  # refused
                    self.counts.overloaded += 1
                    failed.append(turned)
                    continue
            self.room.admit(req)
            self.counts.requests += 1
        out = Decisions(failed=tuple(failed), ignored=tuple(ignored), moved=tuple(moved))
        return out + self.handout.fill(now, Trigger.REQUEST)

    def bubble_start(self, b: BubbleOpened, now: float) -> Decisions[P]:
        if not self.enabled:
            return Decisions(ignored=(Ignored(f"bubble of {b.worker}", "BubbleTea is disabled in the spec"),))
        if now - b.started > self.stale_bubble_s:
            why = f"started {now - b.started:.1f}s ago: history (read from the backlog after a restart)"
            return Decisions(ignored=(Ignored(f"bubble of {b.worker}", why),))
        c = self.book.seen(b.worker, b.address, b.dc, b.free_memory, now)
        self.book.opened(c, Bubble(b.started, b.predicted_s, b.tag))
        self._bubble_seen = True
        return self.handout.fill(now, Trigger.BUBBLE_START)

    def bubble_end(self, e: BubbleClosed, now: float) -> Decisions[P]:
        """Training input arrived: the bubble is over (what runs stops at a layer boundary). Its
        length joins the worker's typical bubble; the batches that finished in it give their
        credit back now. With a `tag`, only the bubble it names is closed (an end that overtook
        the next start leaves that one open)."""
        if not self.enabled:
            return Decisions()
        c = self.book.workers.get(e.worker)
        if c is None:
            return Decisions(ignored=(Ignored(f"bubble end of {e.worker}", "no bubble or batch of it known"),))
        if c.bubble is not None and (e.tag is None or c.bubble.tag == e.tag):
            if e.actual_s is not None:  # what it offered prefill: the rest the fit rule refused is not
                self._admission.bubble(c.bubble.started, max(0.0, e.actual_s - e.refused_s), e.worker, c.bubble.tag)
            c.bubble = None
        self.book.ended(c, e.actual_s, e.finished, now)
        return self.handout.fill(now, Trigger.BUBBLE_END)

    def worker_joined(self, j: WorkerReady, now: float) -> Decisions[P]:
        """A worker set up and entered the run: it is in no bubble, and its first may open at once.
        It gets its first credit now, sized by the typical bubble it announced (unless it has
        bubbles on record: a worker rejoining after a recovery), so that bubble, too, starts with
        its work already there."""
        if not self.enabled:
            return Decisions(ignored=(Ignored(f"worker {j.worker}", "BubbleTea is disabled in the spec"),))
        if now - j.at > self.stale_bubble_s:
            why = f"joined {now - j.at:.1f}s ago: history (read from the backlog after a restart)"
            return Decisions(ignored=(Ignored(f"worker {j.worker}", why),))
        self.book.joined(self.book.seen(j.worker, j.address, j.dc, j.free_memory, now), j.typical_s)
        return self.handout.fill(now, Trigger.JOINED)

    def worker_off(self, worker: str, why: str, now: float) -> Decisions[P]:
        """`worker` takes no more prefill: it is offered nothing until a new process joins in its
        slot. What it holds comes back with its reports (it hands it all back)."""
        self.book.off(worker, why, now)
        return Decisions()

    def report(self, batch_id: str, worker: str, progress: list[Progress], now: float) -> Decisions[P]:
        """A worker finished a batch, or handed it back (unrun, or part run)."""
        if not self.book.reported(batch_id, worker):
            # Sent by a previous dispatcher, or already requeued as lost: its requests are being
            # handled afresh, and anything it answered stays answered (first answer wins).
            return Decisions(ignored=(Ignored(f"report of batch {batch_id}", "not in flight"),))
        c = self.book.workers.get(worker)
        finished: list[Finished] = []
        spent: list[Spent] = []
        for p in progress:
            req = self.room.requests.get(p.id)
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
            req.next_layer = max(req.next_layer, p.reached_layer)
            if p.finished or req.next_layer >= self.layers:
                self.room.leave(req)  # from its worker: it was not waiting
                refusals.waited(self._admission, req, p.answered_at if p.answered_at is not None else now)
                finished.append(Finished(req.id, req.ticket))
            else:
                self.room.back(req)
        self.counts.done += len(finished)
        out: Decisions[P] = Decisions(finished=tuple(finished), spent=tuple(spent))
        return out + self.handout.fill(now, Trigger.REPORT)

    def tick(self, now: float) -> Decisions[P]:
        """The timer: close bubbles open far past their prediction, move or fail requests whose time
        is up, requeue batches that never reported (unless their worker is still heard from)."""
        ignored = self.book.close_stuck(now)  # a worker died in its bubble
        moved, failed = refusals.expire(self.room, self._admission, self.book.running, self.tick_s, now)
        self.counts.moved += len(moved)
        self.counts.expired += len(failed)
        lost: list[LostBatch] = []
        for batch_id, b in self.book.overdue(now):
            if (heard := self.book.late_but_alive(b, now)) is not None:  # alive: it waits once more
                ignored.append(Ignored(f"batch {batch_id}", f"late; worker heard {heard:.3f}s ago"))
                continue
            lost += self._worker_lost(b.worker, now)
        out = Decisions(failed=failed, lost=tuple(lost), ignored=tuple(ignored), moved=moved)
        return out + self.handout.fill(now, Trigger.TICK) if lost else out

    def fail_waiting(self, why: str, now: float) -> Decisions[P]:
        """Nothing can serve (the readiness gate says so): fail every request not running in an
        open bubble now, with `why`. One that runs finishes (or is failed once it is handed back)."""
        failed = refusals.unavailable(self.room, self.book.running, why)
        self.counts.unavailable += len(failed)
        return Decisions(failed=failed)

    def adopt(self, b: Adopted, now: float) -> Decisions[P]:
        """A batch an earlier dispatcher of the run sent, that its worker still holds: counted in
        the worker's credit and in flight as if sent now (its report is this dispatcher's to take,
        or its loss), and its requests marked there as they come back (`add_requests`), not sent
        a second time. The worker gets no credit from it: only its next bubble event gives some."""
        if not self.book.adopt(b, now):
            return Decisions(ignored=(Ignored(f"batch {b.batch_id}", "already in flight"),))
        return Decisions()

    # --- what reports teach, and what their absence means ----------------------------------

    def _learn(self, req: Request[P], p: Progress) -> None:
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
        """A batch of `worker` never reported back: the worker is presumed dead (`CreditBook.lost`).
        Its batches' requests queue again at their last reported layer."""
        lost = []
        for batch_id, b in self.book.lost(worker):
            back = [r for r in (self.room.requests.get(i) for i in b.ids) if r is not None and r.on_worker == worker]
            for r in back:
                self.room.back(r)
            self.counts.requeued += len(back)
            lost.append(LostBatch(batch_id, worker, len(back), now - b.report_by))
        return lost
