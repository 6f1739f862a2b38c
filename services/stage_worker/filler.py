"""The worker's fill executor: prefill batches run inside this worker's bubbles, and only there.

Training is the owner, prefill the guest:

* A batch is run only while the worker waits for training input (`fill`, called by the runner in
  a bubble). One that arrives outside a bubble goes straight back to the dispatcher, unrun,
  unless it was staged for the next bubble (`hold`): then it waits here, so that bubble starts
  filling at once, and goes back unrun if no bubble starts within `HOLD_STAGED_S`.
* The batch runs in a thread on the `PrefillModel`, one block at a time; before each block it
  checks whether the awaited activation or gradient has arrived, and yields at that layer
  boundary. The runner resumes training as soon as the thread returns: within one block's time.
* Afterwards, off the training path (a background task): finished requests are answered (first
  token, logprobs, KV handle) and their KV caches stored; preempted ones are snapshotted so any
  worker can resume them; and one `PrefillReport` tells the dispatcher where every item got to.
  Only then is the batch acked, so a worker killed mid-batch leaves it for the dispatcher to requeue.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from shared import keys, kvstore, serving
from shared.bus import Bus, Delivery, Reject
from shared.logs import get_logger
from shared.model.prefill import PrefillModel, PrefillResult, PrefillState
from shared.policies.dispatch import HOLD_STAGED_S
from shared.wire import PrefillBatch, PrefillItem, PrefillProgress, PrefillReport
from shared.wire import PrefillResult as ResultMessage

log = get_logger(__name__)

Arrived = Callable[[], bool]


@dataclass
class Outcome:
    item: PrefillItem
    reached: int
    seconds: float
    state: PrefillState | None = None
    result: PrefillResult | None = None
    error: str = ""


@dataclass
class BatchRun:
    started: float  # wall clock when the first block began
    ended: float
    outcomes: list[Outcome]
    preempted: bool


class Filler:
    def __init__(
        self,
        bus: Bus,
        run: str,
        worker: str,
        model: PrefillModel,
        model_name: str,
        kv_ttl_s: int,
        on_span: Callable[[float, float], None],
        min_bubble_s: float = 0.0,
    ) -> None:
        self.bus, self.run, self.worker = bus, run, worker
        self.model, self.model_name, self.kv_ttl_s = model, model_name, kv_ttl_s
        self.on_span, self.min_bubble_s = on_span, min_bubble_s
        self._queue: deque[tuple[PrefillBatch, asyncio.Future[None]]] = deque()
        self._work = asyncio.Event()
        self._post: set[asyncio.Task[None]] = set()
        self.in_bubble = False
        self.batches_run = 0

    # --- the fill stream's handler ---------------------------------------------------------

    async def on_batch(self, d: Delivery) -> None:
        batch = d.message
        if not isinstance(batch, PrefillBatch) or batch.run != self.run:
            raise Reject(f"a worker's fill stream takes PrefillBatch of run {self.run}, got {type(batch).__name__}")
        if not self.in_bubble and not batch.hold:
            # The bubble closed before the batch got here: hand it back at once, unrun.
            await self._finish_batch(batch, BatchRun(0.0, time.time(), [], preempted=True))
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue.append((batch, done))
        self._work.set()
        if not self.in_bubble:
            loop.call_later(HOLD_STAGED_S, self._give_back_held, batch.batch_id)
        await asyncio.shield(done)  # acked once answered and reported

    def _give_back_held(self, batch_id: str) -> None:
        """A staged batch whose bubble never came (training paused or over): back, unrun."""
        if self.in_bubble:
            return  # a bubble is running: the batch will be run or handed back at its end
        for entry in list(self._queue):
            batch, done = entry
            if batch.batch_id == batch_id:
                self._queue.remove(entry)
                self._background(self._finish_batch(batch, BatchRun(0.0, time.time(), [], True)), done)

    # --- inside a bubble (called by the runner) --------------------------------------------

    async def fill(self, arrived: Arrived, training_input: asyncio.Future[Any], predicted_s: float) -> None:
        """Run queued batches until training input has arrived (`arrived()` turns true). A bubble
        predicted shorter than the guard is left alone: staged work waits for a longer one."""
        if predicted_s < self.min_bubble_s:
            await asyncio.wait({training_input})
            return
        self.in_bubble = True
        try:
            while not arrived() and not training_input.done():
                if not self._queue:
                    self._work.clear()
                    waiter = asyncio.ensure_future(self._work.wait())
                    await asyncio.wait({training_input, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    continue
                batch, done = self._queue.popleft()
                states = await self._load_snapshots(batch)
                run = await asyncio.to_thread(self._compute, batch, states, arrived)
                self.batches_run += 1
                if run.outcomes:
                    self.on_span(run.started, run.ended)
                self._background(self._finish_batch(batch, run), done)
        finally:
            self.in_bubble = False
            self._hand_back(staged_too=False)

    def _hand_back(self, *, staged_too: bool) -> None:
        """Queued batches back to the dispatcher, unrun: the ones sent for the bubble that just
        ended (and, when closing, those staged for a next one)."""
        keep: deque[tuple[PrefillBatch, asyncio.Future[None]]] = deque()
        while self._queue:
            batch, done = self._queue.popleft()
            if batch.hold and not staged_too:
                keep.append((batch, done))
                continue
            self._background(self._finish_batch(batch, BatchRun(0.0, time.time(), [], True)), done)
        self._queue = keep

    async def _load_snapshots(self, batch: PrefillBatch) -> dict[str, PrefillState | None]:
        """The saved states of resumed items (None when one has expired)."""
        resumed = [it for it in batch.items if it.from_layer > 0]
        states: dict[str, PrefillState | None] = {}
        for it in resumed:
            snap = await kvstore.load_snapshot(self.bus.redis, it.snapshot_key)
            states[it.id] = kvstore.restore(snap, self.model.cfg.layers) if snap is not None else None
        return states

    def _compute(self, batch: PrefillBatch, states: dict[str, PrefillState | None], arrived: Arrived) -> BatchRun:
        """In a worker thread: the items in order, block by block, until done or preempted."""
        started = time.time()
        outcomes: list[Outcome] = []
        preempted = False
        for item in batch.items:
            if arrived():
                preempted = True
                break
            t0 = time.perf_counter()
            if item.from_layer and states.get(item.id) is None:
                outcomes.append(
                    Outcome(item, item.from_layer, 0.0, error="its saved partial state expired before it could resume")
                )
                continue
            try:
                state = states.get(item.id) or self.model.start(item.tokens)
                self.model.run_layers(state, max_layers=item.to_layer - state.next_layer, should_stop=arrived)
                result = None
                if state.done:
                    result = self.model.finish(
                        state, temperature=item.temperature, seed=item.seed, top_logprobs=item.logprobs
                    )
            except ValueError as exc:  # a prompt this model cannot run (e.g. another spec's limits)
                outcomes.append(Outcome(item, item.from_layer, 0.0, error=str(exc)))
                continue
            outcomes.append(Outcome(item, state.next_layer, time.perf_counter() - t0, state, result))
            if state.next_layer < item.to_layer:
                preempted = True
                break
        return BatchRun(started, time.time(), outcomes, preempted)

    # --- after the batch, off the training path --------------------------------------------

    def _background(self, work: Coroutine[Any, Any, None], done: asyncio.Future[None]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:
                # The batch stays unacked: the dispatcher requeues it when no report arrives.
                log.error("prefill batch post-processing failed", worker=self.worker, error=repr(exc))
                if not done.done():
                    done.set_exception(exc)
                return
            if not done.done():
                done.set_result(None)

        task = asyncio.create_task(run())
        self._post.add(task)
        task.add_done_callback(self._post.discard)

    async def _finish_batch(self, batch: PrefillBatch, run: BatchRun) -> None:
        r = self.bus.redis
        progress: list[PrefillProgress] = []
        for o in run.outcomes:
            if o.result is not None:
                await self._answer(o, o.result)
                progress.append(PrefillProgress(id=o.item.id, reached_layer=o.reached, seconds=o.seconds, done=True))
            elif o.error:
                await serving.answer(
                    r,
                    ResultMessage(id=o.item.id, ok=False, error=o.error, worker=self.worker, finished=time.time()),
                    o.item.reply_to,
                )
                progress.append(
                    PrefillProgress(id=o.item.id, reached_layer=o.reached, seconds=0.0, done=True, error=o.error)
                )
            else:
                if o.state is not None and o.reached > o.item.from_layer:
                    key = keys.prefill_snapshot_key(self.run, o.item.id, o.reached)
                    await kvstore.save_snapshot(r, key, kvstore.snapshot(o.item.id, o.state))
                progress.append(PrefillProgress(id=o.item.id, reached_layer=o.reached, seconds=o.seconds))
        ran = {o.item.id for o in run.outcomes}
        unrun = [it for it in batch.items if it.id not in ran]
        progress += [PrefillProgress(id=it.id, reached_layer=it.from_layer, seconds=0.0) for it in unrun]
        await self.bus.publish(
            keys.prefill_reports_stream(self.run),
            PrefillReport(
                run=self.run,
                worker=self.worker,
                batch_id=batch.batch_id,
                progress=tuple(progress),
                started_at=run.started,
                ended_at=run.ended,
                preempted=run.preempted,
            ),
        )

    async def _answer(self, o: Outcome, res: PrefillResult) -> None:
        now = time.time()
        kv_key, kv_size, expires = "", 0, 0.0
        if self.kv_ttl_s > 0:
            kv_key, kv_size = await kvstore.store_kv(
                self.bus.redis, kvstore.kv_message(o.item.id, self.model_name, res.kv), self.kv_ttl_s
            )
            expires = now + self.kv_ttl_s
        prefill_ms = o.seconds * 1000
        await serving.answer(
            self.bus.redis,
            ResultMessage(
                id=o.item.id,
                ok=True,
                token=res.token,
                text=res.text,
                logprob=res.logprob,
                top=tuple((t, lp) for t, lp in res.top),
                prompt_tokens=res.prompt_tokens,
                kv_key=kv_key,
                kv_bytes=kv_size,
                kv_expires_at=expires,
                worker=self.worker,
                queue_ms=max(0.0, (now - o.item.submitted) * 1000 - prefill_ms),
                prefill_ms=prefill_ms,
                finished=now,
            ),
            o.item.reply_to,
        )

    async def close(self) -> None:
        """Hand back what did not run; finish answering and reporting what did."""
        self._hand_back(staged_too=True)
        if self._post:
            await asyncio.gather(*self._post, return_exceptions=True)
