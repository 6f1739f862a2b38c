"""Whether a worker keeps taking prefill after its guest model failed (pure).

Training owns the worker; prefill is its guest. A prefill batch that raises (a `RuntimeError` in
the model, `torch.OutOfMemoryError` on a GPU) fails that batch's running request, hands the rest
back, and training goes on (services/stage_worker/fill/executor.py). One failure may be the request's (an
odd prompt, a transient out-of-memory beside training's peak); a worker whose prefill fails batch
after batch has a broken guest (bad weights, a device that cannot fit both), and every batch sent
there is a request failed. So after `max_failures` failed batches in a row the worker stops taking
prefill for good, and says so: its dispatcher sends it nothing more, and the front door's `/ready`
and the worker's metrics name it. A batch that runs without error resets the count.

`GuestHealth` takes each batch's outcome and returns a `GuestVerdict`: whether to keep taking
prefill, and why, in a sentence an operator can act on.

How much device memory the guest may use is measured, not worked out from the spec
(`guest_memory_cap`): on a GPU, what is free once training's first step has peaked (its
activations, gradients, optimizer state and the allocator's cache are all held then; so are the
guest's weights and CUDA graphs), less a headroom, shared by the workers on that GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Failed batches in a row after which a worker stops taking prefill.
MAX_FAILURES = 3
#: The share of a GPU's memory kept free beside the guest's cap: the allocator's fragmentation,
#: training's later peaks above its first step's, and what CUDA libraries take as they warm up.
GUEST_HEADROOM = 0.10


def guest_memory_cap(
    free: int, total: int, *, sharers: int = 1, ceiling: int | None = None, headroom: float = GUEST_HEADROOM
) -> int:
    """The bytes a worker's guest may use on its GPU, from `free` and `total` as
    `torch.cuda.mem_get_info` measured them after training's first step peaked: `free` less
    `headroom` of `total`, split evenly among the `sharers` workers on that GPU, at most `ceiling`
    (the spec's figure), never below 0."""
    if sharers < 1:
        raise ValueError(f"sharers must be >= 1, got {sharers}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    cap = max(0, int(free - headroom * total)) // sharers
    return cap if ceiling is None else max(0, min(cap, ceiling))


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
