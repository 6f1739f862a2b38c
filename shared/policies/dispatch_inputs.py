"""The dispatch policy's inputs and tables (`shared.policies.dispatch`), and its windows.

The inputs (`Request`, `BubbleOpened`, `WorkerReady`, `Progress`) are what a service or the
simulator feeds `DispatchState`; the tables (`Bubble`, `InFlight`, `Counts`) are what it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Bubble lengths remembered per worker, to size the batch staged for its next bubble.
RECENT_BUBBLES = 8
# The policy's own windows are sized against bubbles, so they are in device seconds: at a time
# scale k, `DispatchState` stretches them by k like every device time of the spec (docs/config.md,
# "Clocks"), and each keeps the share of a bubble it has at k = 1.
#: Work is staged only on a worker that had a bubble this recently (device s): one that stopped
#: training (run over, or dead) must not keep being handed requests.
STAGE_WINDOW_S = 2.0
#: A batch with no report this long after its predicted end is presumed lost with its worker
#: (device s; a live worker reports within one layer of its bubble's end: milliseconds).
BATCH_GRACE_S = 3.0
#: A bubble event older than this is history (read from the backlog after a restart), not news
#: (device s).
STALE_BUBBLE_S = 1.0
#: How often the service's timer feeds `tick` (device s): deadlines are kept to within this.
TICK_S = 0.05
#: The bubbles' serving rate is measured over this much of the recent past (device s): a few
#: iterations of a pipeline, so it follows a change of load without jumping at each bubble.
RATE_WINDOW_S = 2.0


@dataclass
class Request:
    id: str
    tokens: int
    arrival: float
    kv_bytes: int
    deadline: float | None = None
    ticket: str = ""  # what the service acks once the request is answered or failed (its bus entry)
    payload: Any = None  # passed through to the batches (the service's wire message)
    next_layer: int = 0
    in_bubble: str | None = None  # the worker running (or holding) it now, if any
    assigned_s: float = 0.0  # predicted seconds of the work it was last sent with
    queued_s: float = 0.0  # while waiting: its predicted seconds as counted in the queue's total


@dataclass(frozen=True)
class BubbleOpened:
    """A worker's bubble start, as the policy needs it."""

    worker: str
    address: str  # where that worker takes batches
    predicted_s: float
    free_memory: int
    started: float  # when the bubble began on the worker (the event's trip here is already spent)
    tag: object = None  # which of the worker's bubbles (e.g. (iteration, position)), to match its end


@dataclass(frozen=True)
class WorkerReady:
    """A worker that joined the run, as the policy needs it (its first bubble may open at once)."""

    worker: str
    address: str  # where that worker takes batches
    typical_s: float  # its typical predicted bubble: what work staged on it may fill
    free_memory: int
    at: float  # when it joined, on its clock


@dataclass
class Bubble:
    worker: str
    started: float
    predicted_s: float
    free_memory: int
    sent_s: float = 0.0  # predicted seconds of work sent into this bubble and not yet reported
    sent_bytes: int = 0
    tag: object = None


@dataclass(frozen=True)
class Progress:
    """A worker's report on one request: the layer it reached, the seconds it spent, and whether
    the request is finished (answered by the worker, ok or failed)."""

    id: str
    reached_layer: int
    seconds: float
    finished: bool = False


@dataclass
class InFlight:
    worker: str
    ids: tuple[str, ...]
    report_by: float


@dataclass
class Counts:
    requests: int = 0
    overloaded: int = 0  # refused at arrival (`Admission`)
    batches: int = 0
    done: int = 0
    expired: int = 0
    unavailable: int = 0
    requeued: int = 0
