"""The values the fill executor and its compute share: a held batch's progress (`Queued`), each
item's progress (`Outcome`), and one run of a batch in one bubble (`Run`).

The executor (`executor.py`) decides when and in which thread a batch runs; the compute
(`compute.py`) moves the batch's cursor, one block at a time. The answering state lives apart
(`answers.py`): the compute only calls `Answered` with each outcome as it is answered.

Tested by: tests/integration/test_fill_executor.py, tests/integration/test_kv_budget.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from services.stage_worker.port.prefill import Saved
from shared.model.finishing import Finishing
from shared.model.prefill import PrefillResult, PrefillState
from shared.wire import PrefillBatch, PrefillItem
from shared.wire.status import FailureReason

#: Whether training's awaited input has arrived (polled between blocks, from any thread).
Arrived = Callable[[], bool]


@dataclass
class Outcome:
    """How far one item got on this worker: `reached` layers done in `seconds`, from layer
    `started` (None: the item's `from_layer`; lower when its saved state was elsewhere or lost)."""

    item: PrefillItem
    reached: int
    seconds: float
    state: PrefillState | None = None
    result: PrefillResult | None = None
    #: finished, its first token still on its way off the device (`read` makes it `result`)
    pending: Finishing | None = None
    failure: tuple[FailureReason, str] | None = None
    started: int | None = None
    sent: bool = False  # its answer is on its way (sent as soon as it was answered)
    answered_at: float = 0.0  # wall clock: when its answer was sent (0: not yet)

    @property
    def answered(self) -> bool:
        """Finished here: answered, ok or failed."""
        return self.result is not None or self.pending is not None or self.failure is not None

    async def read(self) -> None:
        """Its first token off the device, now that an answer needs it: waited for and sampled in
        a thread, not in the event loop."""
        if self.pending is not None:
            self.result, self.pending = await asyncio.to_thread(self.pending.result), None


#: Called by a run, in whichever thread runs it, with each outcome answered (done, or failed) as it is:
#: its answer goes at once (the executor sends it from the event loop, `answers.py`).
Answered = Callable[[Outcome], None]


@dataclass
class Queued:
    """A batch on this worker and how far it got: its items before `cursor` are done (or failed);
    `current`, when set, is the one cut part way, its state in memory."""

    batch: PrefillBatch
    states: dict[str, Saved]  # resumed items' saved states, loaded on arrival
    outcomes: list[Outcome] = field(default_factory=list)  # every item started here, in order
    cursor: int = 0
    current: Outcome | None = None

    def left_s(self) -> float:
        """The predicted seconds of what is left of it (the dispatcher's prediction)."""
        return sum(it.predicted_ms for it in self.batch.items[self.cursor :]) / 1000


@dataclass
class Run:
    """One run of a batch in one bubble: when it ran, the blocks it ran, whether the batch is done."""

    started: float  # wall clock when its first block began
    ended: float
    blocks: int
    finished: bool
    #: the prefill model raised (the exception, in words): the batch stops here, its running request
    #: failed and the rest handed back
    error: str | None = None
    #: the next piece would not fit what is left of the bubble: nothing more starts in it
    full: bool = False
