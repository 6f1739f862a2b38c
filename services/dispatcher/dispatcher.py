"""dispatcher (BubbleTea): puts queued prefill requests into the bubbles workers announce.

A thin async shell around the pure `DispatchState` (shared/policies/dispatch.py). It consumes

* the request stream (every accepted `PrefillRequest`; acked only once the request is answered
  or failed, so a dispatcher killed mid-flight leaves it pending for its successor),
* the run's bubble stream (`BubbleStart` / `BubbleEnd` from every worker),
* the run's report stream (`PrefillReport`: how far each item of a batch got),

feeds them to the state with the clock, and sends the `PrefillBatch`es it decides on to the
workers' fill streams. A timer fails requests whose deadline passed (explicitly, through
`shared.serving.answer`) and requeues batches that never reported back (their worker died).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass

import msgspec

from shared import keys, serving
from shared.bus import Bus, Delivery, Reject
from shared.config import ClusterSpec
from shared.health import Heartbeat, instance_id
from shared.logs import get_logger
from shared.model.gpt import GPTConfig
from shared.model.prefill import estimate_kv_bytes
from shared.policies.dispatch import HOLD_STAGED_S, Dispatch, DispatchState, Progress, Request
from shared.settings import Settings
from shared.wire import (
    BubbleEnd,
    BubbleStart,
    PrefillBatch,
    PrefillItem,
    PrefillReport,
    PrefillRequest,
    PrefillResult,
)

SERVICE = "dispatcher"
#: How often deadlines and unanswered batches are checked.
TICK_S = 0.05
#: A batch with no report this long after its predicted end is presumed lost with its worker
#: (a live worker reports within one layer of its bubble's end, milliseconds).
BATCH_GRACE_S = 3.0
#: Requests held at once (each is one waiting handler, acked when answered): the front door's
#: admission limit bounds the real number far below this.
MAX_HELD_REQUESTS = 1_000_000
#: A bubble event older than this is history (read from the backlog after a restart), not news.
STALE_BUBBLE_S = 1.0
#: A progress line in the log this often.
LOG_EVERY_S = 10.0

log = get_logger(__name__)


@dataclass
class InFlight:
    worker: str
    ids: list[str]
    expires: float  # time.monotonic()


class Dispatcher:
    """The dispatcher's state and its reactions; `serve` wires it to the bus."""

    def __init__(self, bus: Bus, spec: ClusterSpec, run: str) -> None:
        bt = spec.bubbletea
        self.bus, self.spec, self.run = bus, spec, run
        self.model_cfg = GPTConfig.from_spec(spec.prefill.model)
        self.state = DispatchState(
            layers=self.model_cfg.layers,
            guard_s=bt.guard_ms / 1000,
            overhead_s=bt.dispatch_overhead_ms / 1000,
            max_batch=bt.max_batch_requests,
            order=bt.order,
            stage_next=bt.stage_ms > 0,
            stage_s=bt.stage_ms / 1000,
            ahead_s=bt.keep_ahead_ms / 1000,
        )
        self.requests: dict[str, PrefillRequest] = {}
        self.answered: dict[str, asyncio.Future[None]] = {}
        self.fill_streams: dict[str, str] = {}
        self.batches: dict[str, InFlight] = {}
        self._batch_ids = itertools.count()
        self._tag = secrets.token_hex(3)
        self.counts = {"requests": 0, "batches": 0, "done": 0, "expired": 0, "requeued": 0}

    # --- inputs ----------------------------------------------------------------------------

    async def on_request(self, d: Delivery) -> None:
        req = d.message
        if not isinstance(req, PrefillRequest):
            raise Reject(f"the request stream takes PrefillRequest, got {type(req).__name__}")
        if isinstance(await serving.lookup(self.bus.redis, req.id), PrefillResult):
            return  # answered before a restart redelivered it
        done = self.answered.get(req.id)
        if done is None:
            done = self.answered[req.id] = asyncio.get_running_loop().create_future()
            self.requests[req.id] = req
            self.counts["requests"] += 1
            entry = Request(
                id=req.id,
                tokens=len(req.tokens),
                arrival=req.submitted,
                kv_bytes=estimate_kv_bytes(self.model_cfg, len(req.tokens)),
                deadline=req.deadline,
            )
            await self._send(self.state.add_request(entry, time.time()))
        await asyncio.shield(done)  # acked once answered or failed

    async def on_bubble(self, d: Delivery) -> None:
        m, now = d.message, time.time()
        if isinstance(m, BubbleStart):
            if not self.spec.bubbletea.enabled or now - m.at > STALE_BUBBLE_S:
                return  # off, or an old event (e.g. read from the backlog after a restart)
            self.fill_streams[m.worker] = keys.fill_stream(self.run, m.replica, m.stage)
            dispatches = self.state.bubble_start(
                m.worker,
                m.predicted_ms / 1000,
                m.free_memory_bytes,
                now,
                started=m.at,
                tag=(m.iteration, m.position),
            )
            await self._send(dispatches)
        elif isinstance(m, BubbleEnd):
            await self._send(self.state.bubble_end(m.worker, tag=(m.iteration, m.position), now=now))
        else:
            raise Reject(f"the bubble stream takes BubbleStart/BubbleEnd, got {type(m).__name__}")

    async def on_report(self, d: Delivery) -> None:
        m = d.message
        if not isinstance(m, PrefillReport):
            raise Reject(f"the report stream takes PrefillReport, got {type(m).__name__}")
        if self.batches.pop(m.batch_id, None) is None:
            # Not a batch of ours in flight: sent by a previous dispatcher, or already requeued as
            # lost. Its requests are being handled afresh; anything it answered stays answered.
            return
        layers = self.state.layers
        progress = [
            # a request the worker answered with an error is finished too (nothing to resume)
            Progress(p.id, layers, 0.0) if p.done and p.error else Progress(p.id, p.reached_layer, p.seconds)
            for p in m.progress
        ]
        finished, dispatches = self.state.report(m.worker, progress, time.time())
        for rid in finished:
            self._finish(rid)
            self.counts["done"] += 1
        await self._send(dispatches)

    # --- timers ----------------------------------------------------------------------------

    async def tick(self) -> None:
        now = time.time()
        for rid in self.state.expire(now):
            await self._fail_expired(rid, now)
        lost = [bid for bid, b in self.batches.items() if b.expires < time.monotonic()]
        for bid in lost:
            b = self.batches.pop(bid)
            self.counts["requeued"] += len(b.ids)
            log.warning(
                "batch never reported back; its worker is presumed gone, requeueing",
                batch=bid,
                worker=b.worker,
                requests=len(b.ids),
            )
            # A live worker reports within a layer of its bubble's end: this one died (or hangs).
            # Close its bubble too, or its requests would keep being sent there until their
            # deadlines; if it is alive after all, its next BubbleStart opens a bubble again.
            self.state.worker_lost(b.worker)
            await self._send(self.state.requeue(b.worker, b.ids, now))

    async def _fail_expired(self, rid: str, now: float) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        waited = now - req.submitted
        result = PrefillResult(
            id=rid,
            ok=False,
            error=f"deadline passed after {waited:.1f}s in the queue: no pipeline bubble had room for it "
            "(is a training run with BubbleTea enabled going on?)",
            prompt_tokens=len(req.tokens),
            queue_ms=waited * 1000,
            finished=now,
        )
        await serving.answer(self.bus.redis, result, req.reply_to)
        self.counts["expired"] += 1
        self._finish(rid)

    def _finish(self, rid: str) -> None:
        self.requests.pop(rid, None)
        fut = self.answered.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # --- output ----------------------------------------------------------------------------

    async def _send(self, dispatches: list[Dispatch]) -> None:
        for dsp in dispatches:
            stream = self.fill_streams.get(dsp.worker)
            if stream is None:  # cannot happen: a bubble is only open after its start named it
                log.error("no fill stream for worker", worker=dsp.worker)
                continue
            items = []
            for a in dsp.assignments:
                req = self.requests[a.id]
                items.append(
                    PrefillItem(
                        id=req.id,
                        tokens=req.tokens,
                        from_layer=a.from_layer,
                        to_layer=a.to_layer,
                        temperature=req.temperature,
                        seed=req.seed,
                        logprobs=req.logprobs,
                        submitted=req.submitted,
                        reply_to=req.reply_to,
                        snapshot_key=keys.prefill_snapshot_key(self.run, req.id, a.from_layer) if a.from_layer else "",
                    )
                )
            predicted = sum(a.seconds for a in dsp.assignments)
            batch_id = f"{self._tag}-{next(self._batch_ids)}"
            # A staged batch may wait on its worker for the next bubble to start.
            expires = time.monotonic() + predicted + BATCH_GRACE_S + (HOLD_STAGED_S if dsp.hold else 0.0)
            self.batches[batch_id] = InFlight(dsp.worker, [a.id for a in dsp.assignments], expires)
            self.counts["batches"] += 1
            await self.bus.publish(
                stream,
                PrefillBatch(
                    run=self.run,
                    worker=dsp.worker,
                    batch_id=batch_id,
                    items=tuple(items),
                    sent_at=time.time(),
                    predicted_s=predicted,
                    hold=dsp.hold,
                ),
            )

    def info(self) -> dict[str, object]:
        return {
            "run": self.run,
            "queued": sum(1 for r in self.state.requests.values() if r.in_bubble is None),
            "running": sum(1 for r in self.state.requests.values() if r.in_bubble is not None),
            "open_bubbles": len(self.state.bubbles),
            **self.counts,
        }


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    spec, run = settings.spec, settings.run
    async with Bus(settings.require_redis_url(), spec.bus, name=SERVICE) as bus:
        d = Dispatcher(bus, spec, run)
        me = f"{SERVICE}-{instance_id()}"
        hb = Heartbeat(bus.redis, SERVICE, instance_id(), d.info)
        held = msgspec.structs.replace(spec.bus, concurrency=MAX_HELD_REQUESTS)
        # Bubble events are handled one at a time, in order: a bubble's end never overtakes its start.
        ordered = msgspec.structs.replace(spec.bus, concurrency=1)
        consumers = [
            bus.consumer(keys.bubbles_stream(run), SERVICE, d.on_bubble, name=me, config=ordered),
            bus.consumer(keys.prefill_reports_stream(run), SERVICE, d.on_report, name=me, config=ordered),
            bus.consumer(keys.PREFILL_REQUESTS_STREAM, SERVICE, d.on_request, name=me, config=held),
        ]
        await hb.start()
        for c in consumers:
            await c.start()
        log.info("dispatcher ready", run=run, enabled=spec.bubbletea.enabled, order=spec.bubbletea.order)
        next_log = time.monotonic() + LOG_EVERY_S
        try:
            while not stop.is_set():
                crashed = next((c for c in consumers if c.crashed.is_set()), None)
                if crashed is not None:
                    raise RuntimeError(f"consumer of {crashed.stream} crashed: {crashed.error!r}")
                await d.tick()
                if time.monotonic() > next_log:
                    next_log += LOG_EVERY_S
                    log.info("dispatcher progress", **d.info())
                try:
                    async with asyncio.timeout(TICK_S):
                        await stop.wait()
                except TimeoutError:
                    pass
        finally:
            for c in reversed(consumers):
                # Requests waiting for answers stay pending for the next dispatcher: no grace.
                await c.stop(grace_s=0 if c.stream == keys.PREFILL_REQUESTS_STREAM else None)
            await hb.stop()
