"""Walks the pipeline schedule with real compute, the bus for tensors, and bubble announcements.

One `StageRunner` per worker process. Torch work runs in a thread (`in_torch_thread`) so the
event loop keeps receiving tensors meanwhile. With a device profile each compute action is padded
to its profiled duration (lag is reported when real compute is slower).

Over 300 lines on purpose: one schedule walk whose actions (compute, send, receive-or-bubble,
all-reduce, telemetry) share the iteration's state; the outbox and the fill executor live beside it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from services.stage_worker.filler import Filler
from services.stage_worker.lease import Slot
from services.stage_worker.mailbox import Mailbox
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.outbox import Outbox, wan_transfer
from services.stage_worker.recovery import CheckpointStore
from services.stage_worker.trainer import StageTrainer
from shared import keys
from shared.bus import Bus
from shared.config import ClusterSpec
from shared.logs import get_logger
from shared.policies.bubbles import BubblePredictor
from shared.policies.placement import Placement
from shared.policies.recovery import checkpoint_due
from shared.policies.schedules import Op, schedule
from shared.policies.wan import transfer_priority
from shared.tensors import TensorBlob, to_blob
from shared.timing import sleep_until
from shared.wire import (
    BubbleEnd,
    BubbleStart,
    GradShard,
    IterationDone,
    SpanRecord,
    StageTensor,
)

#: The prefill-lag warning is logged at most this often (with the sum since the last one).
LAG_WARN_EVERY_S = 60.0

log = get_logger(__name__)


@dataclass
class Profile:
    """Seconds each operation counts for; None = as long as the real computation takes."""

    fwd: float | None = None
    bwd: float | None = None
    allreduce: float = 0.0
    step: float = 0.0


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
    checkpoints: CheckpointStore | None = None  # where `training.checkpoint_every` checkpoints go
    #: The run's recovery generation this runner trains in (stamped on every tensor it sends).
    generation: int = 0
    iteration: int = 0
    lag_s: float = 0.0
    _spans: list[SpanRecord] = field(default_factory=list)
    _lag_warned_at: float = -LAG_WARN_EVERY_S  # monotonic; the first lag is warned at once
    _lag_unreported_ms: float = 0.0
    _lag_iterations: int = 0
    outbox: Outbox = field(init=False)
    #: The one thread the stage's torch work runs in. One, so that work stays in order even when
    #: a cut-short iteration's last operation still runs while the run restores a checkpoint.
    _torch: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = Outbox(self.bus)
        self._torch = ThreadPoolExecutor(1, thread_name_prefix=f"torch-{self.slot.name}")

    async def in_torch_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking torch work in the stage's thread, after whatever is already there."""
        return await asyncio.get_running_loop().run_in_executor(self._torch, fn, *args)

    def close(self) -> None:
        self._torch.shutdown(wait=False)

    def enter_generation(self, generation: int) -> None:
        """The run resumes in `generation`: what a cut-short iteration recorded is dropped (the
        caller empties the mailbox and restores the trainer)."""
        self.generation = generation
        self._spans = []

    @property
    def stage(self) -> int:
        return self.slot.stage

    @property
    def replica(self) -> int:
        return self.slot.replica

    async def run_all(self, start: int = 0) -> None:
        """Train from iteration `start` (after a resumption: the checkpoint's next) to the end."""
        tr = self.spec.training
        actions = schedule(tr.schedule, self.stage, self.spec.parallelism.pp, tr.microbatches)
        limit = tr.iteration_limit
        # until_stopped: until cancelled
        for it in range(start, limit) if limit is not None else itertools.count(start):
            self.iteration = it
            started, self.lag_s = time.time(), 0.0
            await self._iteration(it, actions)
            if self.checkpoints is not None and checkpoint_due(it, tr.checkpoint_every):
                blob = await self.in_torch_thread(self.trainer.checkpoint)
                await self.checkpoints.save(self.slot, it, blob)
            loss = self.trainer.take_loss()
            prefill_lag_ms = self.filler.take_lag() * 1000 if self.filler is not None else 0.0
            self._flush_spans()
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
                generation=self.generation,
            )
            self.outbox.send_many(keys.events_stream(self.run), [done], maxlen=keys.EVENTS_MAXLEN)
            if self.metrics is not None:
                self.metrics.iteration(started, done.ended, loss, self.lag_s, prefill_lag_ms / 1000)
            self.outbox.raise_if_failed()
            self.mailbox.forget_before(lambda k, it=it: k[1] >= it)
            log.info(
                "iteration done",
                slot=self.slot.name,
                iteration=it,
                loss=loss if loss is not None else "-",
                ms=(time.time() - started) * 1000,
                lag_ms=self.lag_s * 1000,
                prefill_lag_ms=prefill_lag_ms,
            )
            self._warn_prefill_lag(it, prefill_lag_ms)

    def _warn_prefill_lag(self, it: int, lag_ms: float) -> None:
        """Never hidden (the prefill profile claims a faster device than this one keeps up with),
        but a service that trains for days must not warn every iteration: at most one line per
        `LAG_WARN_EVERY_S`, summing what it covers (the metric prefill_lag_seconds_total has it all)."""
        if lag_ms <= 0:
            return
        self._lag_unreported_ms += lag_ms
        self._lag_iterations += 1
        now = time.monotonic()
        if now < self._lag_warned_at + LAG_WARN_EVERY_S:
            return
        log.warning(
            "prefill fell behind its device profile",
            slot=self.slot.name,
            iteration=it,
            iterations_behind=self._lag_iterations,
            lag_ms=self._lag_unreported_ms,
            next_warning_in_s=LAG_WARN_EVERY_S,
        )
        self._lag_warned_at, self._lag_unreported_ms, self._lag_iterations = now, 0.0, 0

    async def _iteration(self, it: int, actions: tuple[Any, ...]) -> None:
        held: dict[tuple[str, int], torch.Tensor] = {}
        for pos, a in enumerate(actions):
            op, mb = a.op, a.mb
            if op is Op.FWD:
                out = await self._compute(
                    "fwd", it, mb, self.profile.fwd, self.trainer.forward, it, mb, held.pop(("act", mb), None)
                )
                if out is not None:
                    held[("out", mb)] = out
            elif op is Op.BWD:
                gin = await self._compute(
                    "bwd", it, mb, self.profile.bwd, self.trainer.backward, mb, held.pop(("grad", mb), None)
                )
                if gin is not None:
                    held[("gin", mb)] = gin
            elif op is Op.SEND_ACT:
                self._send("act", it, mb, held.pop(("out", mb)), self.stage + 1)
            elif op is Op.SEND_GRAD:
                self._send("grad", it, mb, held.pop(("gin", mb)), self.stage - 1)
            elif op in (Op.RECV_ACT, Op.RECV_GRAD):
                what = "act" if op is Op.RECV_ACT else "grad"
                held[(what, mb)] = await self._recv((what, it, mb), it, pos)
            elif op is Op.ALLREDUCE:
                await self._allreduce(it)
            elif op is Op.STEP:
                await self._compute("step", it, -1, self.profile.step or None, self.trainer.step)

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
        self._span(kind, it, t0, time.time(), mb)
        return result

    def _send(self, what: str, it: int, mb: int, tensor: torch.Tensor, dst: int) -> None:
        """Queue the tensor for stage `dst` on the outbox and go on computing (training is the
        owner: a send never delays the next operation). Same-DC sends go to the peer's inbox;
        cross-DC sends go to the broker, stamped with this moment as the start of the wire."""
        msg = StageTensor(
            run=self.run,
            what=what,
            iteration=it,
            microbatch=mb,
            replica=self.replica,
            src_stage=self.stage,
            dst_stage=dst,
            tensor=to_blob(tensor),
            generation=self.generation,
        )
        target = keys.inbox(self.run, self.replica, dst)
        src_dc, dst_dc = self.placement.stage_dc[self.stage], self.placement.stage_dc[dst]
        if src_dc == dst_dc:
            self.outbox.send(target, msg)
            return
        transfer_id = f"{what}:{it}:{mb}:{self.replica}:{self.stage}"
        priority = transfer_priority(it, mb, self.replica)
        transfer = wan_transfer(self.run, msg, transfer_id, src_dc, dst_dc, target, priority)
        self.outbox.send(keys.wan_stream(self.run), transfer)

    async def _recv(self, key: tuple[Any, ...], it: int, pos: int) -> torch.Tensor:
        """Take a tensor from the mailbox; if it is not there yet, this is a bubble: announce it."""
        if self.mailbox.ready(key):
            return await self.mailbox.take(key)
        predicted = self.predictor.predict(pos)
        t0, started = time.time(), time.monotonic()
        # Through the outbox: staged prefill starts now, not after a round trip to Redis.
        self.outbox.send(
            keys.bubbles_stream(self.run),
            BubbleStart(
                run=self.run,
                worker=self.slot.name,
                replica=self.replica,
                stage=self.stage,
                dc=self.placement.stage_dc[self.stage],
                iteration=it,
                position=pos,
                predicted_ms=predicted * 1000,
                free_memory_bytes=self.free_memory_bytes,
                at=t0,
            ),
        )
        value = await self._wait_filling(key, predicted, started)
        t1 = time.time()
        self.predictor.observe(pos, predicted, t1 - t0, it)
        if self.metrics is not None:
            self.metrics.bubble(t1 - t0, predicted)
        self.outbox.send(
            keys.bubbles_stream(self.run),
            BubbleEnd(
                run=self.run,
                worker=self.slot.name,
                replica=self.replica,
                stage=self.stage,
                iteration=it,
                position=pos,
                predicted_ms=predicted * 1000,
                actual_ms=(t1 - t0) * 1000,
                at=t1,
            ),
        )
        arrived = self.mailbox.arrived_at(key) or t1
        self._span("wait", it, t0, t1, key[2] if len(key) > 2 else -1, predicted_ms=predicted * 1000, input_at=arrived)
        return value

    async def _wait_filling(self, key: tuple[Any, ...], predicted_s: float, started: float) -> Any:
        """Wait for `key`; meanwhile, with BubbleTea, run prefill until it arrives. `started`: when
        the bubble began (time.monotonic())."""
        if self.filler is None:
            return await self.mailbox.take(key)
        take = asyncio.ensure_future(self.mailbox.take(key))
        try:
            await self.filler.fill(lambda: self.mailbox.arrived(key), take, predicted_s, started)
            return await take
        finally:
            if not take.done():
                take.cancel()

    async def _allreduce(self, it: int) -> None:
        """Average gradients with the DP peers of this stage, summing in replica order everywhere
        so every replica ends with bit-identical gradients. Like a real collective it ends for all
        peers at the same instant: the latest peer's arrival plus the profiled cost (the peers'
        wall clocks are one machine's, or NTP-synchronised)."""
        dp = self.spec.parallelism.dp
        t0 = time.time()
        ready = {self.replica: t0}
        if dp > 1:
            # In the thread: the copy off the device for the wire stays off the event loop.
            mine, blob = await self.in_torch_thread(self._flat_grads_and_blob)
            shard = GradShard(
                run=self.run,
                iteration=it,
                stage=self.stage,
                replica=self.replica,
                tensor=blob,
                ready_at=t0,
                generation=self.generation,
            )
            for peer in range(dp):
                if peer != self.replica:
                    self.outbox.send(keys.inbox(self.run, peer, self.stage), shard)
            grads = {self.replica: mine}
            for peer in range(dp):
                if peer != self.replica:
                    grads[peer], ready[peer] = await self.mailbox.take(("shard", it, peer))
            # Summed on this worker's device, in replica order everywhere.
            await self.in_torch_thread(self.trainer.load_mean, [grads[r] for r in range(dp)])
        if self.profile.allreduce:
            done_wall = max(ready.values()) + self.profile.allreduce
            await sleep_until(time.monotonic() + (done_wall - time.time()))
        self._span("allreduce", it, t0, time.time())

    def _flat_grads_and_blob(self) -> tuple[torch.Tensor, TensorBlob]:
        """This stage's flat gradients (on the device) and their CPU copy for the wire."""
        mine = self.trainer.flat_grads()
        return mine, to_blob(mine)

    # --- telemetry -------------------------------------------------------------------------

    def _span(
        self,
        kind: str,
        it: int,
        start: float,
        end: float,
        mb: int = -1,
        *,
        predicted_ms: float = -1.0,
        input_at: float = 0.0,
    ) -> None:
        self._spans.append(
            SpanRecord(
                run=self.run,
                replica=self.replica,
                stage=self.stage,
                iteration=it,
                span=kind,
                start=start,
                end=end,
                microbatch=mb,
                predicted_ms=predicted_ms,
                input_at=input_at,
            )
        )

    def prefill_span(self, start: float, end: float) -> None:
        self._span("prefill", self.iteration, start, end)
        if self.metrics is not None:
            self.metrics.prefill(end - start)

    def _flush_spans(self) -> None:
        """An iteration's spans go out together, in one round trip."""
        spans, self._spans = self._spans, []
        if spans:
            self.outbox.send_many(keys.spans_stream(self.run), spans, maxlen=keys.SPANS_MAXLEN)
