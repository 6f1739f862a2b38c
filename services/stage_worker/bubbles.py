"""A stage worker's bubbles: announced with their predicted length, filled with prefill, ended.

The runner calls `BubbleAnnouncer.wait` where its device would idle (a receive whose tensor is not
there, the step's collectives waiting for the other stages). The bubble goes out on the outbox at
once, saying what prefill this worker holds, and the fill executor runs that work until the
awaited input has arrived (`Filler.fill`: nothing waits on a round trip to Redis); the bubble's
end (its length, the batches that finished in it, what is still held) and its `wait` span follow.
The predictor learns each bubble's length at its schedule position.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.stage_worker.filler import Filler
from services.stage_worker.guest import DeviceLost
from services.stage_worker.lease import Slot
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.outbox import Outbox
from services.stage_worker.telemetry import StageTelemetry
from shared.control import keys
from shared.policies.bubbles import BubblePredictor
from shared.wire import BubbleEnd, BubbleStart, WorkerJoined


@dataclass
class BubbleAnnouncer:
    outbox: Outbox
    run: str
    slot: Slot
    dc: str
    predictor: BubblePredictor
    free_memory_bytes: int
    telemetry: StageTelemetry
    metrics: WorkerMetrics | None = None

    def joined(self) -> None:
        """Tell the dispatcher this worker has set up and entered the run (with BubbleTea on): its
        first bubble may open the moment every slot has, so its first batch is staged here now,
        not sent after that bubble's start made a round trip through the bus."""
        self.outbox.send(
            keys.bubbles_stream(self.run),
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
        ends_at = time.monotonic() + predicted if predicted > 0 else None  # pieces fit into what is left
        # A worker that takes no prefill (its prefill failed batch after batch, or it is leaving the
        # run) announces nothing: no dispatcher fills its bubbles, and admission must not count them.
        announce = filler is None or filler.taking
        filler = filler if announce else None
        if announce:  # through the outbox, and prefill queued here starts now: no round trip first
            self.outbox.send(
                keys.bubbles_stream(self.run),
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
        self.predictor.observe(pos, predicted, length, it)
        if self.metrics is not None:
            self.metrics.bubble(length, predicted)
        if announce:  # even if prefill stopped in it: the dispatcher closes the bubble it was told of
            self.outbox.send(
                keys.bubbles_stream(self.run),
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
                ),
            )
        self.telemetry.span("wait", it, t0, t1, mb, predicted_ms=predicted * 1000, input_at=arrived_at() or t1)
        return value
