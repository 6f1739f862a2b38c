"""dispatcher (BubbleTea): keeps prefill work queued on every worker ahead of its bubbles.

A thin shell around the pure `DispatchState` (shared/policies/dispatch.py): it decodes what its
three streams carry, feeds it to the state with the clock, executes the `Decisions` the state
returns, and logs each decision with its why (at debug: one line per batch would cost the hot path
its time). The streams, each read in batches and handled in order (`Bus.consumer(sequential=True)`):

* the request stream, `{PrefillRequest}`: every accepted request. Its entry is *held* (not acked)
  until the request is answered or failed, so a dispatcher killed mid-flight leaves it pending for
  its successor, without a task parked per request. A read's requests join the state together
  (`add_requests`). Redis is asked whether a request was answered already only when it is
  delivered again (a restart, a reclaim), never on its first delivery;
* the bubble stream, `{BubbleStart, WorkerJoined, BubbleEnd}`; the report stream, `{PrefillReport}`.
  Each is the run's, or with a dispatcher per datacenter its datacenter's (`keys.bubbles_stream`).

What one read decided is executed once the read is handled (`flush`): every batch, failure answer
and snapshot deletion in **one round trip**, then the acks, all fenced by the run's dispatcher
lease (services/dispatcher/writes.py: a deposed leader writes none of it). A timer feeds the state
`tick(now)`: deadlines passed, batches that never reported back.

Every `verdicts.READINESS_EVERY_S` the dispatcher judges whether prefill can be served at all (the
pure `ServingGate` of shared/policies/readiness.py, fed the run's slot leases and the bubbles seen)
and publishes the verdict for the front doors (`/ready`, and a 503 for new requests when nothing
can serve). When the verdict says so (training finished, stopped, lost a worker, or stalled), it
fails every request still waiting, explicitly, instead of letting each wait for its deadline.

Here: the handlers, executing decisions, the readiness check; every decision is in shared/policies.
The process around it (its lease, its terms' consumers and the timer, metrics, heartbeat): serve.py.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from typing import Protocol

from services.dispatcher.lease import DispatcherLease
from services.dispatcher.messages import answers, batch_message, unanswerable, unused_states
from services.dispatcher.metrics import DispatcherMetrics
from services.dispatcher.telemetry import ControlTelemetry
from services.dispatcher.writes import Writes, execute
from shared.bus import HOLD, Bus, Delivery, Outcome, Reject
from shared.bus.connection import TRANSIENT_ERRORS, ride_out
from shared.config.spec import ClusterSpec
from shared.control import serving, verdicts
from shared.control.health import instance_id
from shared.control.leases import generation_joined, read_slots
from shared.figures.percentiles import percentile
from shared.model.shape import model_info
from shared.policies.decisions import Decisions
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import BubbleClosed, BubbleOpened, Progress, Request, WorkerReady
from shared.policies.readiness import ServingGate, Verdict
from shared.runtime.logs import get_logger
from shared.wire import (
    BubbleEnd,
    BubbleStart,
    PrefillOff,
    PrefillReport,
    PrefillRequest,
    WorkerJoined,
    encode,
    keys,
)
from shared.wire.status import ControlEvent, FailureReason, RequestStatus, ServingState

SERVICE = "dispatcher"
#: Decision latencies kept for the heartbeat's percentiles (the last this many flushes).
DECISIONS_KEPT = 10_000

log = get_logger(__name__)


class Acks(Protocol):
    """A consumer whose entries (held requests, a read's) the dispatcher acks in its round trips."""

    stream: str
    group: str

    def forget_held(self, ids: list[str]) -> None: ...

    def release_all(self, ids: list[str]) -> None: ...


class Dispatcher:
    """Feeds `DispatchState` from the bus and executes what it decides."""

    def __init__(
        self,
        bus: Bus,
        spec: ClusterSpec,
        run: str,
        time_scale: float = 1.0,
        *,
        lease: DispatcherLease | None = None,
        metrics: DispatcherMetrics | None = None,
        dc: str | None = None,
    ) -> None:
        """`spec` is on the time scale `time_scale`. Under a `lease` (a term of the leader of the run or
        of datacenter `dc`: serve.py) it writes only while it holds it, named for it; else unfenced."""
        bt = spec.bubbletea
        self.bus, self.spec, self.run, self.dc = bus, spec, run, dc
        self.model_info = model_info(spec.prefill)  # the served model's layers and KV size (config.json if HF)
        self.state = DispatchState[PrefillRequest].from_spec(
            spec.bubbletea, self.model_info.layers, time_scale=time_scale, batch_prefix=secrets.token_hex(3)
        )
        self.acks: Acks | None = None  # the request stream's consumer, once it exists
        self.telemetry = ControlTelemetry(bus, run)  # for the run's spans stream, published by the timer
        self.metrics = metrics or DispatcherMetrics(run, spec.prefill.model_name)
        self.lease = lease
        self.instance = lease.me if lease is not None else f"{SERVICE}-{instance_id()}"
        tr = spec.training
        self.gate = ServingGate(
            run=run,
            enabled=bt.enabled,
            unready_after_s=bt.unready_after_s,
            # the workers wait this long for a replacement, plus a lease TTL to notice the loss
            recovery_s=tr.recovery_timeout_s + keys.LEASE_TTL_MS / 1000 if tr.recovers else 0.0,
        )
        self.verdict = Verdict.of(ServingState.STARTING, "the dispatcher is starting")
        self.metrics.serving_state(self.verdict.state)
        self._arriving: list[Request[PrefillRequest]] = []  # requests of the read being handled
        #: what the read being handled decided, executed by `flush`
        self._decided: Decisions[PrefillRequest] = Decisions()
        #: when the first stream input since the last flush was handled (perf_counter), and per flush
        #: of a read its decision latency: that input's handling to the decisions written (seconds;
        #: the timer's own flushes are not counted)
        self._since: float | None = None
        self.decision_s: deque[float] = deque(maxlen=DECISIONS_KEPT)

    # --- handlers (the tables are in serve.py) ---------------------------------------------

    async def on_request(self, d: Delivery) -> Outcome | None:
        req = d.message
        self._input()
        assert isinstance(req, PrefillRequest)
        if (why := unanswerable(self.run, self.dc, req)) is not None:
            raise Reject(why)
        found = await serving.lookup(self.bus.redis, self.run, req.id, self.dc) if d.attempt > 1 else None
        if found is not None and found.status is not RequestStatus.QUEUED:  # delivered again, answered meanwhile
            return None  # ack
        self._arriving.append(
            Request(
                id=req.id,
                tokens=len(req.tokens),
                arrival=req.submitted,
                kv_bytes=self.model_info.kv_bytes(len(req.tokens)),
                deadline=req.deadline,
                ticket=d.id,
                payload=req,
                objective=req.objective,
                may_move=req.may_move,
                decoder_s=req.decoder_s,
                admitted=found is not None,  # delivered again (a restart, a takeover), queued: admitted then
            )
        )
        return HOLD  # acked once answered or failed

    async def requests_read(self, done: list[str]) -> bool:
        """After a read of the request stream: its requests join the state together, then `flush`
        (`done`: entries answered before, to ack)."""
        now = time.time()
        arriving, self._arriving = self._arriving, []
        self._decided += self.state.add_requests(arriving, now)
        if self.verdict.fail_queued:  # accepted by a front door that had not heard yet
            self._decided += self.state.fail_waiting(self.verdict.reason, now)
        return await self.flush(self.acks, done)

    async def on_start(self, d: Delivery) -> None:
        m = d.message
        self._input()
        assert isinstance(m, BubbleStart)
        opened = BubbleOpened(
            worker=m.worker,
            address=keys.fill_stream(self.run, m.replica, m.stage, self.dc),
            predicted_s=m.predicted_ms / 1000,
            free_memory=m.free_memory_bytes,
            started=m.at,
            tag=(m.iteration, m.position),
            dc=m.dc,
            queued_s=m.queued_ms / 1000,
        )
        now = time.time()
        # with work: the worker held some as it opened, or requests waited here for it
        with_work = m.queued_ms > 0 or self.state.work_for(m.worker)
        self.metrics.bubble_started(m.queued_ms / 1000, self.state.work_for(m.worker))
        if now - m.at <= self.state.stale_bubble_s:  # a bubble from the backlog says nothing about training now
            self.gate.saw_bubble(m.at)
            if not self.verdict.ready and self.gate.recheck_due(time.monotonic()):  # training runs: say so now
                await self.check_readiness()
        self._decided += self.state.bubble_start(opened, now)
        self.telemetry.seen(ControlEvent.BUBBLE_START, m.worker, m.at, now, with_work=with_work)

    async def on_joined(self, d: Delivery) -> None:
        m = d.message
        self._input()
        assert isinstance(m, WorkerJoined)
        log.info("worker joined", worker=m.worker, typical_bubble_ms=round(m.typical_bubble_ms, 2))
        ready = WorkerReady(
            worker=m.worker,
            address=keys.fill_stream(self.run, m.replica, m.stage, self.dc),
            typical_s=m.typical_bubble_ms / 1000,
            free_memory=m.free_memory_bytes,
            at=m.at,
            dc=m.dc,
        )
        self.gate.prefill_on(m.worker)
        self._decided += self.state.worker_joined(ready, time.time())

    async def on_off(self, d: Delivery) -> None:
        """A worker stopped taking prefill (its prefill failed batch after batch): nothing more goes
        there, and the readiness verdict says so now."""
        m = d.message
        self._input()
        assert isinstance(m, PrefillOff)
        log.warning("worker takes no more prefill", worker=m.worker, reason=m.reason)
        self.gate.prefill_off(m.worker, m.reason)
        self._decided += self.state.worker_off(m.worker, m.reason, time.time())
        await self.check_readiness()

    async def on_end(self, d: Delivery) -> None:
        m = d.message
        self._input()
        assert isinstance(m, BubbleEnd)
        self.metrics.bubble_ended(m.actual_ms, m.predicted_ms)
        closed = BubbleClosed(m.worker, (m.iteration, m.position), m.actual_ms / 1000, m.finished, m.refused_ms / 1000)
        self._decided += self.state.bubble_end(closed, time.time())

    async def on_report(self, d: Delivery) -> None:
        m = d.message
        self._input()
        assert isinstance(m, PrefillReport)
        progress = [
            Progress(
                p.id,
                p.reached_layer,
                p.seconds,
                p.outcome.finished,
                None if p.started_layer < 0 else p.started_layer,
                p.answered_at or None,
            )
            for p in m.progress
        ]
        now = time.time()
        run, recomputed = self.state.counts.layers_run, self.state.counts.layers_recomputed
        self._decided += self.state.report(m.batch_id, m.worker, progress, now)
        if log.isEnabledFor(10):
            finished = sum(p.finished for p in progress)
            log.debug("batch reported", batch=m.batch_id, worker=m.worker, items=len(progress), finished=finished)
        if m.at > 0:
            c = self.state.counts
            self.telemetry.seen(
                ControlEvent.REPORT,
                m.worker,
                m.at,
                now,
                run=c.layers_run - run,
                recomputed=c.layers_recomputed - recomputed,
            )

    def _input(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    async def tick(self) -> None:
        self._decided += self.state.tick(time.time())
        await self.flush()
        await self.telemetry.flush()

    async def check_readiness(self) -> None:
        """Judge whether anything can serve, publish the verdict, and act on it. With Redis away
        nothing is judged: the published verdict expires, and the next check tries again."""
        p = self.spec.parallelism
        try:
            slots = await read_slots(self.bus.redis, self.run, p.pp, p.dp)
            joined = await generation_joined(self.bus.redis, self.run, p.pp * p.dp)
        except TRANSIENT_ERRORS as exc:
            log.warning("readiness check failed", error=repr(exc))
            return
        now = time.time()
        verdict = self.gate.assess(slots, now, joined=joined)
        if verdict.state is not self.verdict.state:
            # the run's own course, and its ends on purpose, are news; losses and stalls are alarms
            quiet = (
                ServingState.SERVING,
                ServingState.JOINING,
                ServingState.STARTING,
                ServingState.FINISHED,
                ServingState.STOPPED,
                ServingState.DISABLED,
            )
            level = log.info if verdict.state in quiet else log.warning
            level("serving state", state=verdict.state.value, was=self.verdict.state.value, reason=verdict.reason)
        self.verdict = verdict
        self.metrics.serving_state(verdict.state)
        record = verdicts.Readiness(
            instance=self.instance,
            run=self.run,
            state=verdict.state,
            reason=verdict.reason,
            retry_after_s=verdict.retry_after_s,
            at=now,
            came_round=self.state.came_round(now),
        )
        try:
            await verdicts.publish_readiness(self.bus.redis, record)
        except TRANSIENT_ERRORS as exc:
            log.warning("readiness not published", error=repr(exc))
        if verdict.fail_queued:
            self._decided += self.state.fail_waiting(verdict.reason, now)

    # --- executing decisions ---------------------------------------------------------------

    async def flush(self, read: Acks | None = None, done: list[str] | None = None) -> bool:
        """Execute what was decided since the last flush: every batch, failure answer and state
        deletion in one round trip (riding out a Redis restart), and after them in the same round
        trip the acks of what is done (the held requests answered or failed, and `done`, the
        entries of the read handled, of the consumer `read`); then the metrics and the logs. With
        nothing to write, no round trip is made for the acks alone: they go with their consumers'
        own, which gathers many (`Acks`). Returns whether it acked `done` (a consumer's
        `AfterRead`). Under a lease nothing is written once it is lost (`writes`): the term ends,
        and the entries stay pending for the leader to claim."""
        ds, self._decided = self._decided, Decisions()
        if self.lease is not None and not self.lease.leads():
            self.lease.refused("its lease lapsed before it wrote what it decided (a stall, or Redis away)")
            return True  # nothing written, nothing acked
        tickets = [f.ticket for f in ds.failed] + [m.ticket for m in ds.moved] + [f.ticket for f in ds.finished]
        held, entries = (self.acks, tickets) if self.acks is not None else (None, [])
        if read is None or not done:
            read, done = None, []
        w = Writes(
            batches=[(b.address, encode(batch_message(self.run, b, self.dc))) for b in ds.batches],
            answers=answers(ds),
            gone=unused_states(self.run, ds, self.state.layers, self.dc),
            acks=[(c.stream, c.group, ids) for c, ids in ((held, entries), (read, done)) if c is not None],
        )
        if not w:  # nothing to write: the acks alone wait for the next round trip of their
            if held is not None:  # consumers' own (which gathers many)
                held.release_all(entries)
            self._record_decision()
            self._done(ds)
            return False
        fence = self.lease.fence() if self.lease is not None else None
        written = await ride_out(
            lambda: execute(self.bus.redis, self.run, w, fence, self.dc), "dispatcher decisions", unless=self.bus.stop
        )
        if not written and self.lease is not None:
            self.lease.refused("Redis refused its writes: the lease is not its own")
            return True
        if held is not None:
            held.forget_held(entries)
        self._record_decision()
        self._done(ds)
        return read is not None

    def _record_decision(self) -> None:
        if self._since is not None:
            self.decision_s.append(time.perf_counter() - self._since)
            self._since = None

    def _done(self, ds: Decisions[PrefillRequest]) -> None:
        """What follows the writes: acks, metrics, one log line per decision (batches and ignored
        inputs at debug)."""
        self.metrics.batches_sent(len(ds.batches))
        if log.isEnabledFor(10):
            for b in ds.batches:
                log.debug("batch sent", batch=b.batch_id, worker=b.worker, items=len(b.items), **b.why.fields())
            for ignored in ds.ignored:
                log.debug("ignored", what=ignored.what, why=ignored.why)
        for f in ds.failed:
            self.metrics.request_failed(f.reason)
            if f.reason is not FailureReason.OVERLOADED:  # that one: the 429
                log.info("request failed", id=f.id, reason=f.reason.value, detail=f.detail)
            elif log.isEnabledFor(10):
                log.debug("request refused", id=f.id, detail=f.detail)
        for m in ds.moved:
            self.metrics.request_moved()
            if log.isEnabledFor(10):
                log.debug("moved to the decoder", id=m.id, detail=m.why)
        for _ in ds.finished:
            self.metrics.request_finished()
        for lost in ds.lost:
            self.metrics.batch_lost()
            log.warning(
                "batch never reported back: its worker is presumed gone; requests queued again",
                batch=lost.batch_id,
                worker=lost.worker,
                requests=lost.requests,
                overdue_s=round(lost.overdue_s, 3),
            )

    def info(self) -> dict[str, object]:
        """The heartbeat's body: the state's counters, and the decision latency's percentiles over
        the last `DECISIONS_KEPT` flushes (an input handled to its decisions written, ms)."""
        out = {"run": self.run, "dc": self.dc or "", "serving": self.verdict.state.value, **self.state.info()}
        if self.decision_s:
            for q in (50, 99):
                out[f"decision_ms_p{q}"] = round(1000 * (percentile(self.decision_s, q) or 0.0), 3)
        return out
