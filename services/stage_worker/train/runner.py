"""Drives the slot's schedule walk (`shared.policies.walk.SlotWalk`) for real: compute, tensors, collectives.

One `StageRunner` per worker process. Torch work runs in a thread (`in_torch_thread`) so the
event loop keeps receiving tensors meanwhile. Every tensor goes through the stage's port
(`port/stage_port.py`: the data plane, never Redis); the bus carries their announcements. With a device
profile each compute action is padded to its profiled duration (lag is reported when real compute
is slower). A receive whose tensor is not there, and the step's collectives waiting for the other
stages, are bubbles (`fill/announcer.py`); the iteration's spans go out together (`telemetry.py`).

Tested by: tests/e2e/test_training_correctness.py, tests/e2e/test_serving.py, tests/e2e/test_worker_recovery.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn

import torch

from services.stage_worker.fill.announcer import BubbleAnnouncer
from services.stage_worker.fill.executor import Filler
from services.stage_worker.membership.lease import Slot, SlotError
from services.stage_worker.membership.saving import hand_over_state, stop_requested
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.outbox import Outbox
from services.stage_worker.port.stage_port import StagePort
from services.stage_worker.port.tensors import Direction, IterationTensors, TensorKey
from services.stage_worker.telemetry import StageTelemetry
from services.stage_worker.train.timing import Profile
from services.stage_worker.train.trainer import StageTrainer
from shared.bus import Bus
from shared.config.spec import ClusterSpec
from shared.dataplane import PlaneError
from shared.policies.bubbles import BubblePredictor
from shared.policies.pipeline_plan import dispatch_dc
from shared.policies.placement import Placement
from shared.policies.recovery import Resume, checkpoint_due, reports_cut_short, save_due
from shared.policies.schedules import Op, schedule
from shared.policies.walk import END, Phase, SlotWalk, has_step_collectives
from shared.runtime.logs import get_logger
from shared.runtime.priority import lower_this_thread, train_nice
from shared.runtime.timing import sleep_until
from shared.wire import IterationDone, keys

#: After a data-plane failure, how long the runner waits for the recovery path (a peer's lease
#: expiring, a new generation) to cut its iteration short before it gives up itself: three lease
#: lifetimes and two checks of the peers (one lifetime plus a check, 5 s, was too short on a busy
#: machine: a recovery test failed there).
PLANE_FAILURE_GRACE_S = 3 * keys.LEASE_TTL_MS / 1000 + 2 * keys.LEASE_RENEW_S

log = get_logger(__name__)


@dataclass
class StageRunner:
    bus: Bus
    spec: ClusterSpec
    run: str
    slot: Slot
    placement: Placement
    trainer: StageTrainer
    mailbox: Mailbox
    predictor: BubblePredictor
    profile: Profile
    free_memory_bytes: int
    filler: Filler | None = None  # BubbleTea: runs prefill batches in this worker's bubbles
    metrics: WorkerMetrics | None = None  # Prometheus: recorded where the runner has each value
    #: `bubbletea train --save`: replica 0 hands its stage's state to the launcher after the saved iterations.
    saving: bool = False
    #: `bubbletea train --resume`: the iteration saved last and this stage's state then (restored at start).
    resume_from: tuple[int, bytes] | None = None
    #: Every tensor the stage moves: the data plane, checkpoints, saves (set by the worker before training).
    port: StagePort | None = None
    #: The run's recovery generation this runner trains in (stamped on every tensor it sends).
    generation: int = 0
    iteration: int = 0
    lag_s: float = 0.0
    #: Asked to leave the run (a drain): `run_all` returns after the iteration in progress, its
    #: step done, and says which that was in `left_after`.
    leaving: bool = False
    left_after: int | None = None
    #: The iteration in progress (its number, start time and generation) until its report is sent.
    unreported: tuple[int, float, int] | None = None
    outbox: Outbox = field(init=False)
    telemetry: StageTelemetry = field(init=False)
    bubbles: BubbleAnnouncer = field(init=False)
    #: The one thread the stage's torch work runs in. One, so that work stays in order even when
    #: a cut-short iteration's last operation still runs while the run restores a checkpoint.
    _torch: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = Outbox(self.bus)
        self.telemetry = StageTelemetry(self.outbox, self.run, self.replica, self.stage, self.slot.name)
        dc = self.placement.stage_dc[self.stage]
        self.bubbles = BubbleAnnouncer(
            self.outbox,
            self.run,
            self.slot,
            dc,
            self.predictor,
            self.free_memory_bytes,
            self.telemetry,
            self.metrics,
            dispatch_dc=dispatch_dc(self.spec, self.stage),
        )
        self._torch = ThreadPoolExecutor(
            1, thread_name_prefix=f"torch-{self.slot.name}", initializer=lower_this_thread, initargs=(train_nice(),)
        )

    async def in_torch_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking torch work in the stage's thread, after whatever is already there."""
        return await asyncio.get_running_loop().run_in_executor(self._torch, fn, *args)

    def close(self) -> None:
        self._torch.shutdown(wait=False)

    def enter_generation(self, generation: int) -> None:
        """The run resumes in `generation`: what a cut-short iteration recorded is dropped (the
        caller empties the mailbox and restores the trainer)."""
        self.generation = generation
        self.telemetry.drop()
        if self.port is not None:
            self.port.reset()

    @property
    def stage(self) -> int:
        return self.slot.stage

    @property
    def replica(self) -> int:
        return self.slot.replica

    async def run_all(self, start: int = 0) -> None:
        """Train from iteration `start` (after a resumption: the checkpoint's next) to the end."""
        tr = self.spec.training
        pp, limit = self.spec.parallelism.pp, tr.iteration_limit
        walk = SlotWalk(
            self.replica,
            self.stage,
            schedule(tr.schedule, self.stage, pp, tr.microbatches),
            iterations=limit,  # until_stopped (None): until cancelled
            collectives=has_step_collectives(pp, tr.clip_grad_norm, self.trainer.tied is not None),
            start=start,
        )
        while walk.current() is not None:
            it = self.iteration = walk.iteration
            started, self.lag_s = time.time(), 0.0
            self.unreported = (it, started, self.generation)
            await self._iteration(walk)
            await self.bubbles.measure_memory(self.in_torch_thread)  # once, on a GPU: training's first step peaked
            walk.advance()  # past the iteration's END: what follows closes it
            if self.port is not None and self.port.checkpoints and checkpoint_due(it, tr.checkpoint_every):
                blob = await self.in_torch_thread(self.trainer.checkpoint)
                await self.port.save_checkpoint(it, blob)
            stop_here = self.saving and await stop_requested(self.bus.redis, self.run, it)
            if self.saving and self.replica == 0 and (stop_here or save_due(it, tr.save_every, limit)):
                await hand_over_state(self._plane(), self.trainer, self.in_torch_thread, self.slot.name, it)
            self._report(it, started, self.generation)
            if stop_here:
                log.info("stopped cleanly after an iteration, as the launcher asked", slot=self.slot.name, iteration=it)
                return
            if self.leaving and walk.current() is not None:  # (after the last one it simply finishes)
                log.info("leaving the run at a step boundary", slot=self.slot.name, iteration=it)
                self.left_after = it
                return

    def _report(self, it: int, started: float, generation: int) -> None:
        """Iteration `it` is stepped: its IterationDone (with the loss, on the last stage), spans,
        metrics and log line."""
        self.unreported = None
        loss = self.trainer.take_loss()
        prefill_lag_ms = self.filler.take_lag() * 1000 if self.filler is not None else 0.0
        self.telemetry.flush()
        done = IterationDone(
            run=self.run,
            replica=self.replica,
            stage=self.stage,
            iteration=it,
            started=started,
            ended=time.time(),
            loss=loss,
            lag_ms=self.lag_s * 1000,
            prefill_lag_ms=prefill_lag_ms,
            generation=generation,
        )
        self.outbox.send_many(keys.events_stream(self.run), [done], maxlen=keys.EVENTS_MAXLEN)
        if self.metrics is not None:
            self.metrics.iteration(started, done.ended, loss, self.lag_s, prefill_lag_ms / 1000)
        self.outbox.raise_if_failed()
        self.mailbox.forget_before(lambda k: k.iteration >= it)
        log.info(
            "iteration done",
            slot=self.slot.name,
            iteration=it,
            loss=loss if loss is not None else "-",
            ms=(time.time() - started) * 1000,
            lag_ms=self.lag_s * 1000,
            prefill_lag_ms=prefill_lag_ms,
            lr=self.trainer.last_lr,
            grad_norm=self.trainer.last_grad_norm if self.trainer.last_grad_norm is not None else "-",
        )
        self.telemetry.warn_prefill_lag(it, prefill_lag_ms)

    def report_cut_short(self, stepped: int, resume: Resume) -> None:
        """At a recovery's join: the report of the iteration in progress, where the recovery cut
        this worker short between its step and its report (`reports_cut_short`)."""
        if self.unreported is not None and reports_cut_short(self.unreported[0], stepped, resume):
            self._report(*self.unreported)
        self.unreported = None

    async def _iteration(self, walk: SlotWalk) -> None:
        """Drive the walk through one iteration, up to its END: each step's effect, for real."""
        it = walk.iteration
        tensors = IterationTensors()
        total_sq: float | None = None  # the global gradient norm, squared, from the collectives
        while (a := walk.current()) is not END:
            assert a is not None, "a walk ends only after an iteration's END"
            op, mb, pos = a.op, a.mb, walk.pos
            if op is Op.FWD:
                x = tensors.act.take_input(mb)
                out = await self._compute("fwd", it, mb, self.profile.fwd, self.trainer.forward, it, mb, x)
                tensors.act.computed(mb, out)  # goes on as the next stage's activation
            elif op is Op.BWD:
                grad = tensors.grad.take_input(mb)
                gin = await self._compute("bwd", it, mb, self.profile.bwd, self.trainer.backward, mb, grad)
                tensors.grad.computed(mb, gin)  # goes back as the previous stage's gradient
                for cache in (tensors.act, tensors.grad):  # the stage's input and its gradient are dead now
                    if (buf := cache.dead_buffer(mb)) is not None:
                        self._plane().release(buf)
            elif op is Op.SEND_ACT or op is Op.SEND_GRAD:
                _, dst, what, _, _ = walk.sent()
                direction = Direction(what)
                self._send(direction, it, mb, tensors[direction].take_output(mb), dst)
            elif op is Op.RECV_ACT or op is Op.RECV_GRAD:
                key = TensorKey(Direction(walk.awaited()[2]), it, mb)
                tensors[key.direction].received(mb, await self._recv(key, pos))
            elif op is Op.ALLREDUCE:
                await self._allreduce(it)
            elif op is Phase.COLLECTIVES:
                total_sq = await self._collectives(it, pos)
            elif op is Op.STEP:
                await self._compute("step", it, -1, self.profile.step or None, self.trainer.step, it, total_sq)
            walk.advance()

    # --- actions ---------------------------------------------------------------------------

    async def _compute(
        self, kind: str, it: int, mb: int, target: float | None, fn: Callable[..., Any], *args: Any
    ) -> Any:
        t0, lt0 = time.time(), time.monotonic()
        result = await self.in_torch_thread(fn, *args)
        if target is not None:
            spent = time.monotonic() - lt0
            if spent < target:
                await sleep_until(lt0 + target)  # count for the profiled time
            else:
                self.lag_s += spent - target
        self.telemetry.span(kind, it, t0, time.time(), mb)
        return result

    def _plane(self) -> StagePort:
        assert self.port is not None, "the worker sets the port before training"
        return self.port

    def _send(self, direction: Direction, it: int, mb: int, tensor: torch.Tensor, dst: int) -> None:
        """Put the tensor for stage `dst` on the data plane and go on computing (training is the
        owner: a send never delays the next operation; `port/transport.py` says how it travels)."""
        self._plane().send(direction, it, mb, tensor, dst)

    async def _plane_failed(self, error: str) -> NoReturn:
        """Give the recovery path (which cancels this task) a lease's lifetime, then fail."""
        await asyncio.sleep(PLANE_FAILURE_GRACE_S)
        raise SlotError(
            f"slot {self.slot.name}: {error}; no peer was lost and the run did not recover "
            f"within {PLANE_FAILURE_GRACE_S:.0f} s"
        )

    async def _take(self, key: TensorKey) -> Any:
        """The tensor `key` from the mailbox, or, if the data plane fails first (a peer died
        mid-transfer), a `SlotError` after `PLANE_FAILURE_GRACE_S` unless the recovery path
        cuts this iteration short before (it cancels this wait)."""
        port = self._plane()
        take = asyncio.ensure_future(self.mailbox.take(key))
        failed = asyncio.ensure_future(port.failed.wait())
        try:
            await asyncio.wait({take, failed}, return_when=asyncio.FIRST_COMPLETED)
            if take.done():
                return take.result()
            await self._plane_failed(port.error)
        finally:
            for t in (take, failed):
                if not t.done():
                    t.cancel()

    def announce_joined(self) -> None:
        """With BubbleTea on, tell the dispatcher this worker entered the run (`BubbleAnnouncer.joined`)."""
        if self.filler is not None:
            self.bubbles.joined()

    async def _recv(self, key: TensorKey, pos: int) -> torch.Tensor:
        """Take a tensor from the mailbox; if it has not arrived yet, this is a bubble (one that
        landed and waits only for the event loop to put it is not)."""
        if self.mailbox.arrived(key):
            return await self._take(key)
        take = asyncio.ensure_future(self._take(key))
        arrived, arrived_at = partial(self.mailbox.arrived, key), partial(self.mailbox.arrived_at, key)
        return await self.bubbles.wait(key.iteration, pos, key.microbatch, take, arrived, arrived_at, self.filler)

    async def _allreduce(self, it: int) -> None:
        """Average gradients with the DP peers of this stage: a gloo all-reduce of the stage's
        group (inside one DC), then the mean. With a device profile it counts for its profiled
        time from when the last replica reached it (the collective also returns that instant), so
        it ends for all peers at one instant, like the collective it stands in for; real
        communication slower than that is lag.

        The collective waits on a thread of its own, not the torch thread: if a peer is lost
        mid-collective, the run's recovery restores a checkpoint in the torch thread, which must
        not queue behind a collective that can only time out."""
        t0 = time.time()
        latest = t0
        if self.spec.parallelism.dp > 1:
            flat = await self.in_torch_thread(self.trainer.flat_grads_on_cpu)
            try:
                mean, latest = await self._plane().all_reduce_mean(flat, t0)
            except PlaneError as exc:
                # info, as a transfer's failure: a stop on purpose closes the peers' connections too;
                # the membership loop says which it was (services/stage_worker/port/transport.py `_fail`)
                log.info("gradient all-reduce failed; learning why from the slots", slot=self.slot.name, error=str(exc))
                await self._plane_failed(str(exc))
            await self.in_torch_thread(self.trainer.load_grads, mean)
        if self.profile.allreduce:
            behind = time.time() - (latest + self.profile.allreduce)
            if behind < 0:
                await sleep_until(time.monotonic() - behind)
            else:
                self.lag_s += behind
        self.telemetry.span("allreduce", it, t0, time.time())

    async def _collectives(self, it: int, pos: int) -> float | None:
        """The pipeline's own collectives before the step (`_pipeline_collectives`; the walk has
        them when `has_step_collectives`). They wait for every stage of this replica to finish its
        backward passes: the stages that finish first idle there until the last one does, so that
        wait is a bubble like a missing tensor's (announced, filled, at the step's position), not
        unaccounted idle time. Returns the global gradient norm, squared (None: no clipping)."""
        finished: list[float] = []
        phase = asyncio.ensure_future(self._pipeline_collectives(finished))
        total_sq: float | None = await self.bubbles.wait(
            it, pos, -1, phase, phase.done, lambda: finished[0] if finished else None, self.filler
        )
        return total_sq

    async def _pipeline_collectives(self, finished: list[float]) -> float | None:
        """Each on a data-plane thread: the tied embedding's gradient summed across the first and
        the last stage (group ``tie:r<replica>``), and the stages' squared gradient norms summed
        for clipping by the global norm (group ``stages:r<replica>``; the total is returned).
        Every replica computes the same, since its gradients are already the DP mean. Appends to
        `finished` when they are done (wall clock)."""
        trainer, pp = self.trainer, self.spec.parallelism.pp
        total_sq: float | None = None
        try:
            if trainer.tied is not None:
                grad = await self.in_torch_thread(trainer.tied_grad)
                summed = await self._plane().sum_tied(self.replica, grad)
                await self.in_torch_thread(trainer.set_tied_grad, summed)
            if self.spec.training.clip_grad_norm > 0 and pp > 1:
                share = await self.in_torch_thread(trainer.grad_sq_norm)
                both = torch.tensor([share], dtype=torch.float64)
                total = await self._plane().sum_norms(self.replica, both)
                total_sq = float(total.item())
        except PlaneError as exc:
            log.info("pipeline collective failed; learning why from the slots", slot=self.slot.name, error=str(exc))
            await self._plane_failed(str(exc))
        finished.append(time.time())
        return total_sq

    # --- telemetry -------------------------------------------------------------------------

    def prefill_span(self, start: float, end: float) -> None:
        self.telemetry.span("prefill", self.iteration, start, end)
        if self.metrics is not None:
            self.metrics.prefill(end - start)
