"""The fill executor's side of a failing guest (services/stage_worker/fill/executor.py runs it): a request
whose prefill model raised fails, saying so, and drops what it held on the device (its tensors; the
allocator's cache is not emptied: `torch.cuda.empty_cache` is never on a hot path); each failed
batch is counted (`shared.policies.guest`), logged with its traceback and in the metrics; and when
the worker stops taking prefill the dispatcher is told (`PrefillOff` on the run's bubbles stream).
docs/architecture.md ("A failing guest") has the whole behaviour.

Tested by: tests/integration/test_guest_failure.py, tests/integration/test_fill_executor.py,
tests/e2e/test_guest_failure.py."""

from __future__ import annotations

import time
import traceback

from services.stage_worker.fill.batch import Outcome
from services.stage_worker.metrics import WorkerMetrics
from shared.bus import Bus
from shared.model.devices import is_sticky_cuda_error
from shared.policies.guest import GuestHealth, GuestVerdict
from shared.runtime.logs import get_logger
from shared.wire import PrefillOff, keys
from shared.wire.status import FailureReason

log = get_logger(__name__)


class DeviceLost(RuntimeError):
    """A sticky CUDA error (`shared.model.devices.is_sticky_cuda_error`): this process's device
    context is poisoned; only a new process clears it."""


class Guest:
    def __init__(
        self, bus: Bus, run: str, worker: str, metrics: WorkerMetrics | None, dispatch_dc: str | None = None
    ) -> None:
        self.bus, self.run, self.worker, self.metrics = bus, run, worker, metrics
        self.dispatch_dc = dispatch_dc  # whose dispatcher hears it is off (None: the run's one)
        self.health = GuestHealth()
        #: Set by a sticky CUDA error: the device is lost for this process, training too; the fill
        #: executor raises it past its fence, and the worker stops so that recovery replaces it.
        self.poisoned: DeviceLost | None = None
        self._traceback = ""  # the last failure's, for the batch's log line

    @property
    def taking(self) -> bool:
        return self.health.taking

    def failed(self, o: Outcome, exc: Exception) -> str:
        """The prefill model raised `exc` running `o`'s request (in whichever thread ran it): it
        fails, saying so, and drops what it held on the device. Returns the error in words
        (`error_of`). The traceback is kept as text: the exception's own holds the failed run's
        frames, and with them its tensors, until it is dropped."""
        error = f"{type(exc).__name__}: {exc}".strip()[:500]
        self._traceback = "".join(traceback.format_exception(exc))[-4000:]
        if is_sticky_cuda_error(exc) and self.poisoned is None:  # the device is gone for this process
            self.poisoned = DeviceLost(f"prefill on worker {self.worker} hit a sticky CUDA error: {error}")
        o.failure = (FailureReason.PREFILL_ERROR, f"prefill failed on worker {self.worker}: {error}")
        o.state = None
        exc.__traceback__ = None  # its frames held the failed run's tensors: they go back to the allocator's cache
        return o.failure[1]

    @staticmethod
    def error_of(o: Outcome) -> str | None:
        """Whether `o` failed because the prefill model raised, and how (as `failed` said it)."""
        return o.failure[1] if o.failure is not None and o.failure[0] is FailureReason.PREFILL_ERROR else None

    def batch_ended(self, batch_id: str, error: str | None) -> GuestVerdict:
        """A batch is done here: without `error` it ran, and the count of failures in a row starts
        again; with one it failed, counted and logged. The verdict says whether to go on taking
        prefill (if not, the caller hands back what it holds and `say_off`)."""
        if error is None:
            return self.health.ran()
        verdict = self.health.failed(error)
        log.error(
            "prefill batch failed; training goes on",
            worker=self.worker,
            batch=batch_id,
            error=error,
            in_a_row=self.health.in_a_row,
            traceback=self._traceback,
        )
        if self.metrics is not None:
            self.metrics.prefill_failed(taking=verdict.take)
        if not verdict.take:
            log.error("worker takes no more prefill", worker=self.worker, reason=verdict.why)
        return verdict

    async def say_off(self, why: str) -> None:
        """Tell the dispatcher this worker takes no more prefill."""
        off = PrefillOff(run=self.run, worker=self.worker, reason=why, at=time.time())
        await self.bus.publish(keys.bubbles_stream(self.run, self.dispatch_dc), off)
