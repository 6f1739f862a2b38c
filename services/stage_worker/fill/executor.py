"""The worker's fill executor: prefill work queued on this worker runs inside its bubbles, and only there.

Training is the owner, prefill the guest. The queue and its rules are the pure `FillQueue`
(shared/policies/fill.py); this module only obeys it, with threads, the bus and the stage port
(`port/stage_port.py`: snapshots in, and out with the KV caches):

* A batch that arrives joins the queue (the dispatcher's credit on this worker), bubble or not;
  one delivered again (this slot's previous process held it) goes straight back, unrun, and so
  does one arriving while the worker stops.
* From the moment a bubble opens the queue runs on the `PrefillModel`, one block (one layer of one
  request) at a time, until the awaited activation or gradient has arrived: before each block the
  mailbox's `arrived` says whether it has, so prefill yields at that layer boundary and the runner
  resumes training within one block's time. A batch's first block in a bubble runs in the worker's
  event loop, the thread that is on a core as the bubble opens; the rest in the prefill thread
  (`_run` says why).
* A request is answered as soon as it is done (`answers.py`), whether its batch goes on or not; a
  batch the input cut stays at the head with its progress in memory, and continues in the next
  bubble. `fill` returns the batches that finished
  in the bubble, which its `BubbleEnd` names (the dispatcher's credit for them comes back then).
* Afterwards, off the training path (a background task, `reporting.py`): answers, snapshots and
  one `PrefillReport` in one round trip; only then is the batch acked, so a worker killed mid-batch
  leaves it for the dispatcher to requeue.
* **A failing guest never stops the owner.** Whatever the prefill model raises fails the request
  it ran and hands the rest of its batch back; training goes on. After a few failed batches in a
  row the worker takes no more prefill (`guest_faults.py`; docs/architecture.md, "A failing guest").

Tested by: tests/integration/test_fill_executor.py, tests/integration/test_guest_failure.py,
tests/integration/test_prefill_profile.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from services.stage_worker.fill.answers import Answers
from services.stage_worker.fill.batch import Arrived, Queued, Run
from services.stage_worker.fill.compute import BatchCompute, run_to_end
from services.stage_worker.fill.guest_faults import Guest
from services.stage_worker.fill.reporting import Reporter
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port.prefill import Saved
from services.stage_worker.port.stage_port import StagePort
from shared.bus import Bus, Delivery, Reject
from shared.model.prefill import PrefillModel
from shared.policies.fill import Arrival, FillQueue
from shared.policies.prefill_cost import PrefillProfile
from shared.runtime.logs import get_logger
from shared.runtime.priority import lower_this_thread, prefill_nice, prefill_slice_us
from shared.wire import PrefillBatch

log = get_logger(__name__)


@dataclass(frozen=True)
class Held:
    """A batch held here: how far its runs got (the compute's), and how its answers get out."""

    queued: Queued
    answers: Answers


async def until_done(future: asyncio.Future[Any]) -> None:
    """Wait for `future` to finish, whatever it ends in, through any further cancellation of the
    caller (which is raised once it has finished)."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True  # the caller's: the future runs on (a thread cannot be cancelled)
        except Exception:
            pass  # the future's own error: its owner reads it
    if cancelled:
        raise asyncio.CancelledError


class Filler:
    def __init__(
        self,
        bus: Bus,
        run: str,
        worker: str,
        model: PrefillModel,
        model_name: str,
        port: StagePort,
        on_span: Callable[[float, float], None],
        queue: FillQueue,
        profile: PrefillProfile | None = None,
        metrics: WorkerMetrics | None = None,
        piece_tokens: int | None = None,
        dispatch_dc: str | None = None,
    ) -> None:
        self.bus, self.run, self.model, self.port = bus, run, model, port
        self.on_span, self.queue = on_span, queue
        self.reporter = Reporter(bus, run, worker, model_name, port, metrics, dispatch_dc)
        #: Prefill compute runs here, below training and the event loops (`shared.runtime.priority`).
        self._thread = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"prefill-{worker}",
            initializer=lower_this_thread,
            initargs=(prefill_nice(), prefill_slice_us()),
        )
        self.batches: dict[str, Held] = {}
        self.guest = Guest(bus, run, worker, metrics, dispatch_dc)
        self.compute = BatchCompute(model, self.guest, profile, piece_tokens)
        self._work = asyncio.Event()
        self._post: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Why this worker takes no more prefill, where its guest is healthy: it leaves the run
        #: (a drain, `leave`), or its fill executor failed (`fence`).
        self.off: str | None = None
        #: When, in the last bubble, the fit rule refused the next block (wall clock; None: it never
        #: did): the bubble's rest from then on was left empty (`BubbleEnd.refused_ms`).
        self.full_at: float | None = None

    @property
    def taking(self) -> bool:
        """Whether this worker takes prefill now: its guest is healthy and it is not leaving."""
        return self.guest.taking and self.off is None

    @property
    def in_bubble(self) -> bool:
        return self.queue.in_bubble

    # --- the fill stream's handler ---------------------------------------------------------

    async def on_batch(self, d: Delivery) -> None:
        batch = d.message
        assert isinstance(batch, PrefillBatch)  # the handler table routes only this kind here
        if batch.run != self.run:
            raise Reject(f"the fill stream of run {self.run} got a batch of run {batch.run}")
        # a restarted worker re-reads its slot's unacked entries (redelivered)
        arrival = self.queue.delivered(batch.batch_id, redelivered=d.attempt > 1)
        if arrival is Arrival.DUPLICATE:
            log.warning(
                "prefill batch delivered twice: this copy is dropped (a retried write)",
                batch=batch.batch_id,
                entry=d.id,
                action=str(arrival),
            )
            return  # acked: the first copy's report is the one the dispatcher counts
        if arrival is Arrival.RETURN:
            log.info(
                "prefill batch delivered again: a previous worker of this slot held it unfinished",
                batch=batch.batch_id,
                attempt=d.attempt,
                action=str(Arrival.RETURN),
            )
        if arrival is Arrival.RETURN or self._closed or not self.taking:  # died, stopping, leaving, no prefill
            await self.reporter.finish_batch(batch, [], preempted=True)
            return
        # Snapshots are read now, not when the bubble opens: no round trip on its critical path.
        states = await self._load_snapshots(batch)
        predicted = sum(it.predicted_ms for it in batch.items) / 1000
        arrival = self.queue.arrive(batch.batch_id, predicted, time.monotonic())
        assert arrival is Arrival.QUEUE
        held = Held(Queued(batch, states), Answers(asyncio.get_running_loop().create_future()))
        self.batches[batch.batch_id] = held
        self._work.set()
        asyncio.get_running_loop().call_later(self.queue.hold_s, self._give_back_expired)
        await asyncio.shield(held.answers.done)  # acked once answered and reported

    def leave(self, why: str) -> None:
        """The worker was told to leave the run (a drain: it finishes the iteration in progress,
        then hands its slot over). What it holds goes back to the dispatcher now, to be placed on
        workers that stay, rather than at the step boundary; nothing more is taken, and the
        dispatcher is told (`PrefillOff`). A batch running in an open bubble runs on in it, and what
        is left of it, with whatever is queued behind it, goes back as the bubble ends (`fill`)."""
        if self.off is not None or self._closed:
            return
        log.info("leaving the run: handing back the prefill held here", worker=self.reporter.worker, why=why)
        self._stop_taking(why)
        if not self.queue.in_bubble:
            self._hand_back(self.queue.drain())

    def _stop_taking(self, why: str) -> None:
        """No more prefill here (`off`), and the dispatcher is told (`PrefillOff`), once."""
        if self.off is None:
            self.off = why
            self._background(self.guest.say_off(why))

    def _give_back_expired(self) -> None:
        """Batches no bubble took in time (training paused or over): back, with how far they got."""
        self._hand_back(self.queue.expired(time.monotonic()))

    # --- inside a bubble (called by the runner) --------------------------------------------

    async def fill(
        self, arrived: Arrived, training_input: asyncio.Future[Any], ends_at: float | None = None
    ) -> tuple[str, ...]:
        """Run the queue until training input has arrived (`arrived()` turns true), or the next
        block would not fit what is left of the bubble by its predicted end `ends_at` (monotonic
        clock; None: not predicted; the fit rule, `fill.may_start`). Returns the batches that
        finished in this bubble."""
        self.queue.open()
        self.full_at = None
        first = True  # the bubble's first run starts in the event loop (`_run`); later ones in the thread
        try:
            while self.taking and not arrived() and not training_input.done():
                head = self.queue.head()
                if head is None:
                    self._work.clear()
                    waiter = asyncio.ensure_future(self._work.wait())
                    try:
                        await asyncio.wait({training_input, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    continue
                held = self.batches[head.batch_id]
                q = held.queued
                run, first = await self._run(held, arrived, ends_at, in_loop=first), False
                if self.guest.poisoned is not None:  # the device is lost: past the fence, the worker stops
                    raise self.guest.poisoned
                if run.blocks:
                    self.on_span(run.started, run.ended)
                if run.finished or run.error is not None:  # done here (a failed one: what did not start goes back)
                    self.queue.ran(q.batch.batch_id, finished=True)
                    del self.batches[q.batch.batch_id]
                    q.states.clear()  # resumed items' states never started hold device memory
                    self._background(self._finish(held, preempted=run.error is not None), held.answers.done)
                    if not (verdict := self.guest.batch_ended(q.batch.batch_id, run.error)).take:
                        self._hand_back(self.queue.drain())  # and takes no more prefill
                        self._background(self.guest.say_off(verdict.why))
                else:
                    self.queue.ran(q.batch.batch_id, finished=False, left_s=q.left_s())
                    if run.full:  # nothing more fits: the bubble's rest stays empty
                        self.full_at = run.ended
                        break
        finally:
            finished = self.queue.close()
            self._give_back_expired()
            if self.off is not None:  # told to leave while this bubble ran: the rest goes back now
                self._hand_back(self.queue.drain())
        return finished

    async def _run(self, held: Held, arrived: Arrived, ends_at: float | None, *, in_loop: bool) -> Run:
        """Run `held` from where it stopped until it is done or the input arrives: with `in_loop`
        (the bubble's first run) its first block here, in the worker's event loop, and the rest in
        the prefill thread; a later run all in the prefill thread, already awake then, which leaves
        the loop free for what it has to send (the last run's answers and report).

        Why the first block runs here: this thread is the one on a core when the bubble opens (it
        just saw the awaited tensor missing). Handing the whole batch to the prefill thread made
        the batch wait for that thread to wake, get a core and take the interpreter lock, at the
        very moment the pipeline's other workers, Redis and the dispatcher all wake too (2.6-8 ms
        at the tail on 2 cores). The loop is blocked for one block's real compute, in this
        worker's own bubble; the thread has that block's device time to wake in.

        Cancelled (a peer lost: recovery cancels the bubble), the run is cut as training input
        would cut it, at the next block boundary, and awaited before the cancellation goes on: the
        thread must not compute on, nor append to the state that `fill`'s end then hands back or a
        next bubble runs again. The batch keeps its progress, as after any cut."""
        cut = threading.Event()

        def arrived_or_cut() -> bool:
            return cut.is_set() or arrived()

        answered = held.answers.callback(self.reporter.answer)  # queued on this loop before the run's end
        steps = self.compute.steps(held.queued, arrived_or_cut, ends_at, answered)
        if in_loop:
            try:
                next(steps)
            except StopIteration as done:  # nothing more to run (stopped or failed before a 2nd block)
                run: Run = done.value
                return run
        running = asyncio.get_running_loop().run_in_executor(self._thread, run_to_end, steps)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            cut.set()
            await until_done(running)
            raise

    def _hand_back(self, batch_ids: list[str]) -> None:
        """These batches go back to the dispatcher, reporting how far they got."""
        for batch_id in batch_ids:
            held = self.batches.pop(batch_id, None)
            if held is None:  # not held (only after a fault `fence` reports): nothing to report
                log.error("a batch to hand back is not held here", worker=self.reporter.worker, batch=batch_id)
                continue
            self._background(self._finish(held, preempted=True), held.answers.done)

    def fence(self, exc: Exception) -> None:
        """The fill executor itself failed in a bubble (a bug of ours, not the prefill model's error,
        which `guest` counts): training must not see it. Log it with its traceback, hand back what
        is held, take no more prefill, and tell the dispatcher; training goes on."""
        import traceback

        why = f"the fill executor failed: {type(exc).__name__}: {exc}"[:300]
        log.error(
            "prefill stopped on this worker; training goes on",
            worker=self.reporter.worker,
            error=why,
            traceback="".join(traceback.format_exception(exc))[-4000:],
        )
        self._stop_taking(why)
        self.queue.close()
        self.queue.drain()
        self._hand_back(list(self.batches))  # every batch held here, queued or not

    async def _finish(self, held: Held, *, preempted: bool) -> None:
        """Report `held` (its early answers first, so a report never overtakes them)."""
        await held.answers.all_sent()
        await self.reporter.finish_batch(held.queued.batch, held.queued.outcomes, preempted=preempted)

    async def _load_snapshots(self, batch: PrefillBatch) -> dict[str, Saved]:
        """The saved states of resumed items (None when one has expired; `LOST` when its holder is
        gone, `ELSEWHERE` when it is in another datacenter: the item is computed again from its prompt)."""
        states: dict[str, Saved] = {}
        for it in batch.items:
            if it.from_layer > 0:
                states[it.id] = await self.port.load_snapshot(it.snapshot_key, self.model.layers)
        return states

    def take_lag(self) -> float:
        """Prefill lag behind the profile since the last call, seconds."""
        return self.compute.take_lag()

    # --- after a batch, off the training path ----------------------------------------------

    def _background(self, work: Coroutine[Any, Any, None], done: asyncio.Future[None] | None = None) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:
                # The batch stays unacked: the dispatcher requeues it when no report arrives.
                log.error("prefill batch post-processing failed", worker=self.reporter.worker, error=repr(exc))
                if done is not None and not done.done():
                    done.set_exception(exc)
                return
            if done is not None and not done.done():
                done.set_result(None)

        task = asyncio.create_task(run())
        self._post.add(task)
        task.add_done_callback(self._post.discard)

    async def close(self) -> None:
        """Hand back what did not run (and whatever arrives from now on); finish answering and
        reporting what did. Before the fill stream's consumer stops: a batch it delivers meanwhile
        goes straight back rather than waiting, unrun, for the dispatcher's lost-batch timeout."""
        self._closed = True
        self._hand_back(self.queue.drain())
        if self._post:
            await asyncio.gather(*self._post, return_exceptions=True)
        self._thread.shutdown(wait=False)
