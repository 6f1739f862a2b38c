"""The worker's fill executor: prefill batches run inside this worker's bubbles, and only there.

Training is the owner, prefill the guest. Every timing rule is the pure `FillPolicy`
(shared/policies/fill.py); this module only obeys it, with threads, the bus and the stage port
(`port.py`: snapshots in, and out with the KV caches):

* A batch arriving in a bubble runs there; a staged one (`hold`) waits for the next bubble (and
  goes back unrun if none takes it in time); any other goes straight back, unrun.
* The batch runs on the `PrefillModel`, one block at a time; before each block the policy says
  whether it may start (the awaited activation or gradient has not arrived), so the batch yields
  at that layer boundary and the runner resumes training within one block's time. Its first block
  runs in the worker's event loop, the thread that is on a core as the bubble opens; the rest in
  the prefill thread (`_run_batch` says why).
* Afterwards, off the training path (a background task, `reporting.py`): answers, snapshots and
  one `PrefillReport`; only then is the batch acked, so a worker killed mid-batch leaves it for
  the dispatcher to requeue.

Just over 300 lines on purpose: one executor, whose batch steps (`_compute`) pass between the
loop and the prefill thread; splitting the stepping from the queue it serves would hide that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port import StagePort
from services.stage_worker.port_prefill import Saved
from services.stage_worker.reporting import BatchRun, Outcome, Reporter
from shared.bus import Bus, Delivery, Reject
from shared.control.status import FailureReason
from shared.model.prefill import PrefillModel, PrefillState
from shared.policies.fill import Arrival, FillPolicy, Held
from shared.policies.prefill_cost import PrefillProfile
from shared.runtime.logs import get_logger
from shared.runtime.priority import lower_this_thread, prefill_nice, prefill_slice_us
from shared.runtime.timing import Schedule
from shared.wire import PrefillBatch

log = get_logger(__name__)

Arrived = Callable[[], bool]


@dataclass
class Queued:
    batch: PrefillBatch
    done: asyncio.Future[None]  # set once answered and reported: the delivery is acked then
    held: Held
    states: dict[str, Saved]  # resumed items' saved states, loaded on arrival


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
        policy: FillPolicy,
        profile: PrefillProfile | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.bus, self.run, self.model, self.port = bus, run, model, port
        self.on_span, self.policy, self.profile = on_span, policy, profile
        self.reporter = Reporter(bus, run, worker, model_name, port, metrics)
        #: how far prefill batches ran past their profiled schedule (seconds); the runner takes it
        #: each iteration (`take_lag`), the thread adds to it (a float under the GIL)
        self.lag_s = 0.0
        #: Prefill compute runs here, below training and the event loops (`shared.runtime.priority`).
        self._thread = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"prefill-{worker}",
            initializer=lower_this_thread,
            initargs=(prefill_nice(), prefill_slice_us()),
        )
        self._queue: list[Queued] = []
        self._work = asyncio.Event()
        self._post: set[asyncio.Task[None]] = set()
        self.in_bubble = False

    # --- the fill stream's handler ---------------------------------------------------------

    async def on_batch(self, d: Delivery) -> None:
        batch = d.message
        assert isinstance(batch, PrefillBatch)  # the handler table routes only this kind here
        if batch.run != self.run:
            raise Reject(f"the fill stream of run {self.run} got a batch of run {batch.run}")
        redelivered = d.attempt > 1  # a restarted worker re-reads its slot's unacked entries
        action = self.policy.on_arrival(staged=batch.hold, in_bubble=self.in_bubble, redelivered=redelivered)
        if redelivered:
            log.info(
                "prefill batch delivered again: a previous worker of this slot held it unfinished",
                batch=batch.batch_id,
                attempt=d.attempt,
                action=str(action),
            )
        if action is Arrival.RETURN:  # its bubble closed before it got here, or its process died
            await self.reporter.finish_batch(batch, BatchRun.unrun())
            return
        loop = asyncio.get_running_loop()
        # Snapshots are read now, not when the bubble opens: no round trip on its critical path.
        states = await self._load_snapshots(batch)
        q = Queued(batch, loop.create_future(), Held(batch.batch_id, batch.hold, time.monotonic()), states)
        self._queue.append(q)
        self._work.set()
        if action is Arrival.HOLD:
            loop.call_later(self.policy.hold_s, self._give_back_expired_holds)
        await asyncio.shield(q.done)  # acked once answered and reported

    def _give_back_expired_holds(self) -> None:
        """Staged batches whose bubble never came (training paused or over): back, unrun."""
        held = [q.held for q in self._queue]
        self._hand_back(self.policy.expired_holds(held, in_bubble=self.in_bubble, now=time.monotonic()))

    # --- inside a bubble (called by the runner) --------------------------------------------

    async def fill(
        self, arrived: Arrived, training_input: asyncio.Future[Any], predicted_s: float, started: float
    ) -> None:
        """Run queued batches until training input has arrived (`arrived()` turns true). `started`:
        when the bubble began (time.monotonic()); no block starts that would end after its
        predicted end minus the guard."""
        if not self.policy.worth_filling(predicted_s):
            await asyncio.wait({training_input})
            return
        ends_at = self.policy.fill_until(started, predicted_s)
        self.in_bubble = True
        try:
            while not arrived() and not training_input.done():
                i = self.policy.next_batch([q.held for q in self._queue])
                if i is None:
                    self._work.clear()
                    waiter = asyncio.ensure_future(self._work.wait())
                    await asyncio.wait({training_input, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    continue
                q = self._queue.pop(i)
                run = await self._run_batch(q, arrived, ends_at)
                if run.outcomes:
                    self.on_span(run.started, run.ended)
                self._background(self.reporter.finish_batch(q.batch, run), q.done)
                if run.out_of_time:  # the rest of the bubble is the guard's: wait for the input
                    await asyncio.wait({training_input})
        finally:
            self.in_bubble = False
            self._hand_back(self.policy.at_bubble_end([q.held for q in self._queue]))

    async def _run_batch(self, q: Queued, arrived: Arrived, ends_at: float) -> BatchRun:
        """Run one batch: its first block here, in the worker's event loop, and the rest in the
        prefill thread.

        Why the first block runs here: this thread is the one on a core when the bubble opens (it
        just saw the awaited tensor missing). Handing the whole batch to the prefill thread made
        the batch wait for that thread to wake, get a core and take the interpreter lock, at the
        very moment the pipeline's other workers, Redis and the dispatcher all wake too: 2.6-8 ms
        at the tail on a 2-core machine, whatever the thread's priority. The loop is blocked only
        for one block's real compute, during this worker's own bubble; the thread then has that
        block's device time (with a profile) to wake before the next block is due, so a late
        wake-up no longer delays the start, and one later than that shows as prefill lag."""
        steps = self._compute(q.batch, q.states, arrived, ends_at)
        try:
            next(steps)
        except StopIteration as done:  # nothing more to run (stopped or failed before a 2nd block)
            run: BatchRun = done.value
            return run
        return await asyncio.get_running_loop().run_in_executor(self._thread, _run_to_end, steps)

    def _hand_back(self, batch_ids: list[str]) -> None:
        """These queued batches go back to the dispatcher, unrun."""
        if not batch_ids:
            return
        back = [q for q in self._queue if q.held.batch_id in batch_ids]
        self._queue = [q for q in self._queue if q.held.batch_id not in batch_ids]
        for q in back:
            self._background(self.reporter.finish_batch(q.batch, BatchRun.unrun()), q.done)

    async def _load_snapshots(self, batch: PrefillBatch) -> dict[str, Saved]:
        """The saved states of resumed items (None when one has expired; `LOST` when its holder is
        gone, `ELSEWHERE` when it is in another datacenter: the item is computed again from its prompt)."""
        resumed = [it for it in batch.items if it.from_layer > 0]
        states: dict[str, Saved] = {}
        for it in resumed:
            states[it.id] = await self.port.load_snapshot(it.snapshot_key, self.model.layers)
        return states

    def _compute(
        self, batch: PrefillBatch, states: dict[str, Saved], arrived: Arrived, ends_at: float
    ) -> Generator[None, None, BatchRun]:
        """Steps through the batch, pausing (yield) after each block, so that whichever thread
        advances it runs the next block (`_run_batch`); returns the `BatchRun`.

        The items in order, one block (one layer of one request) at a time,
        each started only when the policy allows it. With a device profile the batch keeps to its
        profiled schedule (`Schedule`): a block starts once the previous one is due (a started
        block counts for its whole profiled time, the thread sleeping out the rest: a GPU kernel is
        not cut short), and the batch ends on the device when its last block is due, or when its
        real work ended if that was later (added to `lag_s`). That end, not when the sleeping
        thread woke up, ends the batch's span: a late wake-up is the host's, not the device's."""
        started, origin = time.time(), time.monotonic()
        schedule = Schedule(origin)
        outcomes: list[Outcome] = []
        preempted = out_of_time = False
        for item in batch.items:
            if item.from_layer and states.get(item.id) is None:
                why = "its saved partial state expired before it could resume"
                outcomes.append(Outcome(item, item.from_layer, 0.0, failure=(FailureReason.STATE_EXPIRED, why)))
                continue
            # the item's device time: from when the device is free for it to when it is done
            t0 = max(schedule.due, time.monotonic())
            try:
                saved = states.get(item.id)  # LOST or ELSEWHERE: computed again from the prompt
                state = saved if isinstance(saved, PrefillState) else self.model.start(item.tokens)
                out_of_time = yield from self._run_blocks(state, item.to_layer, arrived, ends_at, schedule)
                result = None
                if state.done:
                    result = self.model.finish(
                        state, temperature=item.temperature, seed=item.seed, top_logprobs=item.logprobs
                    )
            except ValueError as exc:  # a prompt this model cannot run (e.g. another spec's limits)
                outcomes.append(Outcome(item, item.from_layer, 0.0, failure=(FailureReason.MODEL_REFUSED, str(exc))))
                continue
            seconds = max(schedule.due, time.monotonic()) - t0
            outcomes.append(Outcome(item, state.next_layer, seconds, state, result))
            if state.next_layer < item.to_layer:
                preempted = True
                break
        done = time.monotonic()  # the batch's real work ended
        if self.profile is not None:
            self.lag_s += schedule.behind(done)
            if (wait := schedule.wait_s(done)) > 0:
                time.sleep(wait)  # the last block still runs on the device
        return BatchRun(started, started + max(schedule.due, done) - origin, outcomes, preempted, out_of_time)

    def _run_blocks(
        self, state: PrefillState, to_layer: int, arrived: Arrived, ends_at: float, schedule: Schedule
    ) -> Generator[None, None, bool]:
        """Blocks of one request up to `to_layer`, while the policy lets the next one start, each
        started once the batch's `schedule` has the previous one done, pausing after each. Returns
        True when it stopped for time (the input had not arrived)."""
        profiled = self.profile.block_s(len(state.tokens)) if self.profile is not None else None
        expected = profiled  # raw mode: the next block is expected to take as long as the last one
        while state.next_layer < to_layer and not state.done:
            if (wait := schedule.wait_s(time.monotonic())) > 0:
                time.sleep(wait)  # the previous block still runs; sleeping releases the GIL
            input_arrived = arrived()
            if not self.policy.may_start_block(
                input_arrived=input_arrived, now=time.monotonic(), ends_at=ends_at, block_s=expected
            ):
                return not input_arrived
            b0 = time.monotonic()
            self.model.run_layers(state, max_layers=1)
            if profiled is None:
                expected = time.monotonic() - b0
            else:
                schedule.add(profiled)
            yield
        return False

    def take_lag(self) -> float:
        """Prefill lag behind the profile since the last call, seconds."""
        lag, self.lag_s = self.lag_s, 0.0
        return lag

    # --- after the batch, off the training path --------------------------------------------

    def _background(self, work: Coroutine[Any, Any, None], done: asyncio.Future[None]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:
                # The batch stays unacked: the dispatcher requeues it when no report arrives.
                log.error("prefill batch post-processing failed", worker=self.reporter.worker, error=repr(exc))
                if not done.done():
                    done.set_exception(exc)
                return
            if not done.done():
                done.set_result(None)

        task = asyncio.create_task(run())
        self._post.add(task)
        task.add_done_callback(self._post.discard)

    async def close(self) -> None:
        """Hand back what did not run; finish answering and reporting what did."""
        self._hand_back(self.policy.at_close([q.held for q in self._queue]))
        if self._post:
            await asyncio.gather(*self._post, return_exceptions=True)
        self._thread.shutdown(wait=False)


def _run_to_end(steps: Generator[None, None, BatchRun]) -> BatchRun:
    """In the prefill thread: the rest of a batch `_run_batch` started."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            run: BatchRun = done.value
            return run
