"""A stage worker's bubbles: announced with their predicted length, filled with prefill, ended.

The runner calls `BubbleAnnouncer.wait` where its device would idle (a receive whose tensor is not
there, the step's collectives waiting for the other stages). The bubble goes out on the outbox at
once, saying what prefill this worker holds, and the fill executor runs that work until the
awaited input has arrived (`Filler.fill`: nothing waits on a round trip to Redis); the bubble's
end (its length, the batches that finished in it, what is still held) and its `wait` span follow.
The predictor learns each bubble's length at its schedule position.

Each bubble offers the dispatcher the device memory the guest may use (its KV caches must fit). On
the CPU that is the spec's figure; on a GPU it is measured once training's first step has peaked
(`GuestMemory`: `torch.cuda.mem_get_info`, then `shared.policies.guest.guest_memory_cap`), and
until then the guest is offered none, so prefill never takes memory that first peak needs.

Tested by: tests/integration/test_fill_executor.py, tests/unit/test_cuda_rules.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.stage_worker.fill.executor import Filler
from services.stage_worker.fill.guest_faults import DeviceLost
from services.stage_worker.membership.lease import Slot
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port.outbox import Outbox
from services.stage_worker.telemetry import StageTelemetry
from shared.model.devices import gpu_sharers
from shared.policies.bubbles import BubblePredictor
from shared.policies.guest import guest_memory_cap
from shared.runtime.logs import get_logger
from shared.wire import BubbleEnd, BubbleStart, WorkerJoined, keys

log = get_logger(__name__)


@dataclass(frozen=True)
class GuestMemory:
    """How a worker on a GPU measures what its guest may use, once training's first step has peaked."""

    device: torch.device
    sharers: int  # the workers whose slots take this GPU (`shared.model.devices.gpu_sharers`)
    ceiling: int  # the spec's figure: `device.memory_gib` less the two models' bytes

    @classmethod
    def on_gpu(cls, device: torch.device, slot: int, slots: int, ceiling: int) -> GuestMemory:
        """For slot index `slot` of `slots`, on `device` with the slots that share it (`gpu_sharers`)."""
        return cls(device, gpu_sharers(slot, slots, torch.cuda.device_count()), ceiling)

    def measure(self) -> int:
        """In the torch thread: the guest's cap (`guest_memory_cap`) from what is free on the device now."""
        free, total = torch.cuda.mem_get_info(self.device)
        return guest_memory_cap(free, total, sharers=self.sharers, ceiling=self.ceiling)


@dataclass
class BubbleAnnouncer:
    outbox: Outbox
    run: str
    slot: Slot
    dc: str
    predictor: BubblePredictor
    free_memory_bytes: int  # what the guest may use, offered with every bubble
    telemetry: StageTelemetry
    metrics: WorkerMetrics | None = None
    #: On a GPU: measures `free_memory_bytes` once training's first step has peaked (0 until then).
    memory: GuestMemory | None = None
    #: The datacenter whose dispatcher reads its bubbles (None: the run's one: `pipeline_plan.dispatch_dc`).
    dispatch_dc: str | None = None

    async def measure_memory(self, in_torch_thread: Callable[[Callable[[], int]], Awaitable[int]]) -> None:
        """Training's first step has peaked: on a GPU, what the guest may use from the next bubble
        on, measured (`GuestMemory`) in the stage's torch thread, once."""
        if self.memory is None:
            return
        self.free_memory_bytes, self.memory = await in_torch_thread(self.memory.measure), None
        log.info("guest memory measured after training's first step", slot=self.slot.name, bytes=self.free_memory_bytes)

    def joined(self) -> None:
        """Tell the dispatcher this worker has set up and entered the run (with BubbleTea on): its
        first bubble may open the moment every slot has, so its first batch is staged here now,
        not sent after that bubble's start made a round trip through the bus."""
        self.outbox.send(
            keys.bubbles_stream(self.run, self.dispatch_dc),
            WorkerJoined(
                run=self.run,
                worker=self.slot.name,
                replica=self.slot.replica,
                stage=self.slot.stage,
                typical_bubble_ms=self.predictor.typical() * 1000,
                free_memory_bytes=self.free_memory_bytes,
                at=time.time(),
                dc=self.dc,
            ),
        )

    async def wait(
        self,
        it: int,
        pos: int,
        mb: int,
        awaited: asyncio.Future[Any],
        arrived: Callable[[], bool],
        arrived_at: Callable[[], float | None],
        filler: Filler | None,
    ) -> Any:
        """The device idles until `awaited` (training's input: a tensor, or the peers of a
        collective) is done: a bubble. Announce it, fill it with prefill (with a `filler`:
        BubbleTea), announce its end, and return what was awaited. `arrived()`: whether the input
        is here (safe from the prefill thread); `arrived_at()`: since when (wall clock), if known."""
        predicted = self.predictor.predict(pos)
        t0 = time.time()
        room = self.predictor.room(pos)  # blocks fit into what is left (fill.may_start); None: nothing known
        ends_at = None if room is None else time.monotonic() + room
        # A worker that takes no prefill (its prefill failed batch after batch, or it is leaving the
        # run) announces nothing: no dispatcher fills its bubbles, and admission must not count them.
        announce = filler is None or filler.taking
        filler = filler if announce else None
        if announce:  # through the outbox, and prefill queued here starts now: no round trip first
            self.outbox.send(
                keys.bubbles_stream(self.run, self.dispatch_dc),
                BubbleStart(
                    run=self.run,
                    worker=self.slot.name,
                    replica=self.slot.replica,
                    stage=self.slot.stage,
                    dc=self.dc,
                    iteration=it,
                    position=pos,
                    predicted_ms=predicted * 1000,
                    free_memory_bytes=self.free_memory_bytes,
                    at=t0,
                    queued_ms=filler.queue.queued_s * 1000 if filler is not None else 0.0,
                ),
            )
        finished: tuple[str, ...] = ()
        try:
            if filler is not None:
                try:
                    finished = await filler.fill(arrived, awaited, ends_at)
                except DeviceLost:  # a poisoned device stops training too: the worker stops, recovery replaces it
                    raise
                except Exception as exc:  # the guest never stops the owner (cancellation still passes)
                    filler.fence(exc)
            value = await awaited
        finally:
            if not awaited.done():
                awaited.cancel()
        t1 = time.time()
        length = max(0.0, (arrived_at() or t1) - t0)  # the bubble: its start to the input's arrival
        full_at = filler.full_at if filler is not None else None
        refused = max(0.0, t0 + length - full_at) if full_at is not None else 0.0  # its rest nothing fit
        self.predictor.observe(pos, predicted, length, it)
        if self.metrics is not None:
            self.metrics.bubble(length, predicted)
        if announce:  # even if prefill stopped in it: the dispatcher closes the bubble it was told of
            self.outbox.send(
                keys.bubbles_stream(self.run, self.dispatch_dc),
                BubbleEnd(
                    run=self.run,
                    worker=self.slot.name,
                    replica=self.slot.replica,
                    stage=self.slot.stage,
                    iteration=it,
                    position=pos,
                    predicted_ms=predicted * 1000,
                    actual_ms=length * 1000,
                    at=t1,
                    finished=finished,
                    queued_ms=filler.queue.queued_s * 1000 if filler is not None else 0.0,
                    refused_ms=refused * 1000,
                ),
            )
        self.telemetry.span("wait", it, t0, t1, mb, predicted_ms=predicted * 1000, input_at=arrived_at() or t1)
        return value
