"""Training first on the GPU: each side of a stage worker on a CUDA stream of its own.

Training (the owner) runs on a high-priority stream, prefill (the guest) on a low-priority one
(`Lane.training`, `Lane.prefill`; `stream_priority`). The GPU's scheduler then starts a ready
training kernel before queued prefill kernels, and neither side waits for the other's work: each
waits on its own stream (`Lane.wait`), never on the whole device (`torch.cuda.synchronize`, which
made training's every step wait behind whatever prefill had queued). The two sides share no
tensors: each model has its own weights, and what crosses between them goes through the CPU.

CUDA has no priority below the default stream's (0 is the least urgent; PyTorch maps a larger
number to it), so prefill's lane is as urgent as the default stream, and the default stream is
prefill's: what prefill computed is handed to it (`Lane.hand_over`) for the threads that read it
off the GPU. Training never queues work there: every trainer method that touches the device runs
on training's lane, the gradients' copy for the all-reduce included
(`StageTrainer.flat_grads_on_cpu`).

On the CPU a lane has no stream: `scope` enters nothing and `wait` does nothing, so every CPU run
computes exactly what it did before (tests/unit/test_lanes.py pins it).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


class Urgency(enum.Enum):
    """Whose work a lane carries, which sets its stream's priority (`stream_priority`)."""

    TRAINING = "training"  # the owner: first
    #: a done prefill's last head GEMM and its logits' copy to the host: one small kernel and a copy,
    #: as urgent as training, which would otherwise starve them past their bubble
    FINISHING = "finishing"
    PREFILL = "prefill"  # the guest: last


def stream_priority(urgency: Urgency, least: int, greatest: int) -> int:
    """The CUDA stream priority of a lane, from the device's range (`Stream.priority_range()`:
    `least`, `greatest`, e.g. (0, -5); a lower number is more urgent): training and a prefill's
    finishing the most urgent the device has, prefill the least (the default stream's, 0: CUDA
    has none below it)."""
    return least if urgency is Urgency.PREFILL else greatest


class Lane:
    """One side's stream on `device` (None on the CPU)."""

    def __init__(self, device: torch.device, urgency: Urgency) -> None:
        self.device, self.urgency = device, urgency
        self.stream: torch.cuda.Stream | None = None
        self._marks: deque[torch.cuda.Event] = deque()
        if device.type == "cuda":
            least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # static
            self.stream = torch.cuda.Stream(device=device, priority=stream_priority(urgency, least, greatest))

    @classmethod
    def training(cls, device: torch.device) -> Lane:
        return cls(device, Urgency.TRAINING)

    @classmethod
    def prefill(cls, device: torch.device) -> Lane:
        return cls(device, Urgency.PREFILL)

    @classmethod
    def finishing(cls, device: torch.device) -> Lane:
        return cls(device, Urgency.FINISHING)

    @property
    def priority(self) -> int | None:
        return None if self.stream is None else int(self.stream.priority)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Work launched in this block (by this thread) goes on the lane's stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def after(self, other: Lane, *used: torch.Tensor) -> None:
        """What this lane launches next waits for what `other` launched so far (on the GPU, not
        the host); `used`, tensors of `other`'s that this lane reads, are kept from reuse by
        `other` until this lane is done with them (`record_stream`)."""
        if self.stream is not None and other.stream is not None:
            self.stream.wait_stream(other.stream)
            for t in used:
                t.record_stream(self.stream)

    def hand_over(self) -> None:
        """Whatever runs later on the device's default stream (a copy of this lane's results off
        the GPU, from any thread) waits for what this lane launched so far: a dependency on the
        GPU, not a wait of the host. Prefill's only: training never uses the default stream, so
        this never puts training's work behind prefill's."""
        if self.stream is not None:
            torch.cuda.default_stream(self.device).wait_stream(self.stream)

    def pace(self, ahead: int = 1) -> None:
        """After launching a block: keep the host at most `ahead` blocks ahead of the device. A
        kernel launch returns at once, so without this the host would queue a bubble's whole queue
        of prefill before the GPU ran the first block; training's input arriving meanwhile would then
        wait behind all of it. Waits on this lane's own events, in the calling (prefill) thread."""
        if self.stream is None:
            return
        mark = torch.cuda.Event()
        mark.record(self.stream)
        self._marks.append(mark)
        while len(self._marks) > ahead:
            self._marks.popleft().synchronize()

    def wait(self) -> None:
        """Until everything launched on this lane has run (not the other lane's work)."""
        if self.stream is not None:
            self.stream.synchronize()


class LaneClock:
    """How long pieces of work launched on a lane ran, read without waiting for them: on a GPU a
    CUDA event pair per piece, read once the end has passed (`Event.query`, no sync); on the CPU,
    where work is done when its call returns, the host clock."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._measured: list[tuple[int, float]] = []
        self._cpu_start = 0.0

    def begin(self) -> torch.cuda.Event | None:
        """Before launching a piece: its start mark (None on the CPU)."""
        if self.lane.stream is None:
            self._cpu_start = time.perf_counter()
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.lane.stream)
        return start

    def end(self, start: torch.cuda.Event | None, tokens: int) -> None:
        """After launching it: `tokens` tokens' piece from `start` (what `begin` gave)."""
        if start is None or self.lane.stream is None:
            self._measured.append((tokens, time.perf_counter() - self._cpu_start))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.lane.stream)
        self._pending.append((tokens, start, end))

    def in_flight_tokens(self) -> int:
        """The tokens of the pieces launched and not done on the device yet (0 on the CPU, where a
        piece is done when its call returns). Reads events without waiting (`Event.query`)."""
        while self._pending and self._pending[0][2].query():
            tokens, start, end = self._pending.popleft()
            self._measured.append((tokens, start.elapsed_time(end) / 1000))
        return sum(tokens for tokens, _, _ in self._pending)

    def measured(self) -> list[tuple[int, float]]:
        """(tokens, device seconds) of the pieces that ran since the last call, oldest first."""
        while self._pending and self._pending[0][2].query():
            tokens, start, end = self._pending.popleft()
            self._measured.append((tokens, start.elapsed_time(end) / 1000))
        out, self._measured = self._measured, []
        return out


class OnLane(Protocol):
    lane: Lane


S = TypeVar("S", bound=OnLane)


def on_lane(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """A method whose device work runs on its object's `lane`."""

    @functools.wraps(method)
    def run(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lane.scope():
            return method(self, *args, **kwargs)

    return run
