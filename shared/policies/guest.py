"""Whether a worker keeps taking prefill after its guest model failed (pure).

Training owns the worker; prefill is its guest. A prefill batch that raises (a `RuntimeError` in
the model, `torch.OutOfMemoryError` on a GPU) fails that batch's running request, hands the rest
back, and training goes on (services/stage_worker/filler.py). One failure may be the request's (an
odd prompt, a transient out-of-memory beside training's peak); a worker whose prefill fails batch
after batch has a broken guest (bad weights, a device that cannot fit both), and every batch sent
there is a request failed. So after `max_failures` failed batches in a row the worker stops taking
prefill for good, and says so: its dispatcher sends it nothing more, and the front door's `/ready`
and the worker's metrics name it. A batch that runs without error resets the count.

`GuestHealth` takes each batch's outcome and returns a `GuestVerdict`: whether to keep taking
prefill, and why, in a sentence an operator can act on.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Failed batches in a row after which a worker stops taking prefill.
MAX_FAILURES = 3


@dataclass(frozen=True)
class GuestVerdict:
    take: bool  # keep taking prefill
    why: str


@dataclass
class GuestHealth:
    max_failures: int = MAX_FAILURES
    in_a_row: int = 0  # failed batches since the last that ran without error
    failures: int = 0  # every failed batch
    stopped: str | None = None  # why it stopped taking prefill (None: it takes it)

    @property
    def taking(self) -> bool:
        return self.stopped is None

    def ran(self) -> GuestVerdict:
        """A batch ran without error."""
        self.in_a_row = 0
        return GuestVerdict(self.taking, self.stopped or "prefill runs")

    def failed(self, error: str) -> GuestVerdict:
        """A batch failed with `error` (the exception, in words)."""
        self.in_a_row += 1
        self.failures += 1
        if self.stopped is None and self.in_a_row >= self.max_failures:
            self.stopped = (
                f"prefill failed in {self.in_a_row} batches in a row (the last: {error}); "
                "this worker takes no more prefill and trains on"
            )
        if self.stopped is not None:
            return GuestVerdict(False, self.stopped)
        return GuestVerdict(
            True, f"prefill failed ({error}): {self.in_a_row} of {self.max_failures} failed batches in a row"
        )
