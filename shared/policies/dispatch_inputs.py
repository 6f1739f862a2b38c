"""The dispatch policy's inputs and tables (`shared.policies.dispatch`), and its windows.

The inputs (`Request`, `BubbleOpened`, `BubbleClosed`, `WorkerReady`, `Progress`, `Adopted`) are what a service
or the simulator feeds `DispatchState`; the tables (`Credit`, `Bubble`, `InFlight`, `Counts`) are
what it keeps: the credit book (`credit_book.py`) and the waiting room (`waiting_room.py`).

Tested by: tests/unit/test_dispatch.py, tests/unit/test_dispatch_takeover.py.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic

from shared.policies.decisions import P

#: Bubble lengths remembered per worker: its typical bubble, which sizes its credit.
RECENT_BUBBLES = 8
# The policy's own windows are sized against bubbles, so they are in device seconds: at a time
# scale k, `DispatchState` stretches them by k like every device time of the spec (docs/config.md,
# "Clocks"), and each keeps the share of a bubble it has at k = 1.
#: Credit goes only to a worker that had a bubble (or joined) this recently (device s): one that
#: stopped training (run over, or dead) must not keep being handed requests.
STAGE_WINDOW_S = 2.0
#: A batch with no report this long after it could last have run (sent, plus the time a worker may
#: hold it, plus its predicted time) is presumed lost with its worker (device s; a live worker
#: reports within a layer of a bubble's end: milliseconds).
BATCH_GRACE_S = 3.0
#: A bubble open this many times its predicted length (or its worker's typical one) is taken as
#: closed: its worker died in it, or its end was lost. Its requests are then not running, so they
#: move to the decoder or fail at their objective instead of waiting for the lost batch's report.
STUCK_BUBBLE_FACTOR = 3.0
#: A bubble event older than this is history (read from the backlog after a restart), not news
#: (device s).
STALE_BUBBLE_S = 1.0
#: How often the service's timer feeds `tick` (device s): deadlines are kept to within this.
TICK_S = 0.05
#: The bubbles' serving rate is measured over this much of the recent past (device s): a few
#: iterations of a pipeline, so it follows a change of load without jumping at each bubble.
RATE_WINDOW_S = 2.0
#: A request with a saved partial prefill waits at most this long (device s, and never past half
#: of what is left before its deadline) for a worker of the datacenter that holds the state; after
#: that a worker of another DC may take it and compute it again from its prompt.
RESUME_WAIT_S = 0.25


@dataclass
class Request(Generic[P]):
    """A prompt to prefill, from its arrival until it is answered, failed or moved. `payload` is
    what the caller attached (its wire message): the policy hands it back in its decisions."""

    id: str
    tokens: int
    arrival: float
    kv_bytes: int
    deadline: float | None = None
    ticket: str = ""  # what the service acks once the request is answered or failed (its bus entry)
    payload: P = field(kw_only=True)
    next_layer: int = 0
    on_worker: str | None = None  # the worker holding it now (queued there or running), if any
    #: while it waits with a saved partial prefill: the datacenter holding that state, and until
    #: when only a worker there may take it (`RESUME_WAIT_S`)
    state_dc: str = ""
    own_dc_until: float = -math.inf
    queued_s: float = 0.0  # while waiting: its predicted seconds as counted in the queue's total
    #: when its prompt is due for its TTFT objective (the same clock as `deadline`), if it has one
    objective: float | None = None
    #: the decoder may compute it where the bubbles cannot in time (`prefill.placement: auto`)
    may_move: bool = False
    #: what the decoder's recent prompts took to a first token when it came (0: not measured): kept
    #: for the decoder where that is more than `prompt_placement.RESERVE` of its objective
    decoder_s: float = 0.0
    #: admission's uncorrected prediction of its wait, from its arrival to its answer (None: none
    #: was made); its real wait corrects the next predictions (`Admission.waited`)
    predicted_wait_s: float | None = None
    #: a dispatcher before this one held it, still queued (delivered again after a takeover or a
    #: restart): it was admitted then (or was in the read it was judging as it died), and is not
    #: judged again on arrival; its objective still fails it if the bubbles do not reach it in time.
    #: A new leader measures the bubbles' rate afresh, and judged again it was refused (a 429 for
    #: a request accepted) until the pipeline came round once (`Admission.came_round`)
    admitted: bool = False

    @property
    def due(self) -> float | None:
        """When its prompt must be done: its objective or its deadline, the sooner (None: neither)."""
        times = [t for t in (self.objective, self.deadline) if t is not None]
        return min(times) if times else None

    @property
    def objective_s(self) -> float | None:
        """With an objective: the time it is given from its arrival to when it is due (its objective,
        or its deadline if that comes first), of which placement keeps a share; else None."""
        due = self.due
        return due - self.arrival if self.objective is not None and due is not None else None

    def late(self, now: float) -> str:
        """Why it failed at its deadline, in a sentence."""
        what = "objective" if self.objective is not None and self.due == self.objective else "deadline"
        waited = f"{what} passed after {now - self.arrival:.1f}s"
        if self.on_worker is None:
            return f"{waited} in the queue: no worker had credit to spare for it"
        return f"{waited}, queued on worker {self.on_worker}: its bubbles did not reach it in time"


@dataclass(frozen=True)
class BubbleOpened:
    """A worker's bubble start, as the policy needs it."""

    worker: str
    address: str  # where that worker takes batches
    predicted_s: float
    free_memory: int
    started: float  # when the bubble began on the worker (the event's trip here is already spent)
    tag: object = None  # which of the worker's bubbles (e.g. (iteration, position)), to match its end
    dc: str = ""  # the worker's datacenter
    #: what the worker had queued as the bubble opened (predicted seconds), by its own count
    queued_s: float = 0.0


@dataclass(frozen=True)
class BubbleClosed:
    """A worker's bubble end, as the policy needs it: what the bubble was and what it used."""

    worker: str
    tag: object = None  # the bubble it closes (None: whichever is open)
    actual_s: float | None = None  # its length, start to the training input's arrival
    #: batches that finished in it: their credit comes back now, before their reports
    finished: tuple[str, ...] = ()
    #: its rest the fit rule left empty, no block fitting it (`fill.may_start`): not capacity
    refused_s: float = 0.0


@dataclass(frozen=True)
class WorkerReady:
    """A worker that joined the run, as the policy needs it (its first bubble may open at once)."""

    worker: str
    address: str  # where that worker takes batches
    typical_s: float  # its typical predicted bubble: what sizes its credit before it has bubbles
    free_memory: int
    at: float  # when it joined, on its clock
    dc: str = ""


@dataclass(frozen=True)
class Adopted:
    """A batch an earlier dispatcher of the run sent that its worker still holds (its fill stream's
    entry not acked: queued there, running, or not read yet), as a dispatcher taking over finds it."""

    batch_id: str
    worker: str
    address: str  # the worker's fill stream
    items: tuple[tuple[str, int, float], ...]  # (request id, layer it starts from, predicted seconds)
    kv_bytes: int = 0  # the KV memory its requests take there


@dataclass
class Bubble:
    """A worker's open bubble."""

    started: float
    predicted_s: float
    tag: object = None


@dataclass
class Credit:
    """One worker, as the dispatcher sees it: where it takes batches, its bubbles, and the work it
    holds (sent and not yet known to be used: its credit in use)."""

    worker: str
    address: str = ""
    dc: str = ""
    free_memory: int = 0
    last_seen: float = -math.inf  # its last bubble event (or joining)
    lengths: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_BUBBLES))
    #: batch id -> (predicted seconds, KV bytes) of every batch sent here and not known used
    held: dict[str, tuple[float, int]] = field(default_factory=dict)
    held_s: float = 0.0
    held_bytes: int = 0
    bubble: Bubble | None = None
    #: why it takes no prefill (its prefill failed batch after batch: `PrefillOff`); None: it takes it
    off: str | None = None

    def typical_s(self) -> float:
        """Its typical bubble: the mean of its recent ones (0 before any)."""
        return sum(self.lengths) / len(self.lengths) if self.lengths else 0.0

    def hold(self, batch_id: str, seconds: float, kv_bytes: int) -> None:
        self.held[batch_id] = (seconds, kv_bytes)
        self.held_s += seconds
        self.held_bytes += kv_bytes

    def release(self, batch_id: str) -> bool:
        """The batch is used (finished, reported or lost): its credit comes back. False if it was
        not held here (already released)."""
        got = self.held.pop(batch_id, None)
        if got is None:
            return False
        if self.held:
            self.held_s, self.held_bytes = max(0.0, self.held_s - got[0]), max(0, self.held_bytes - got[1])
        else:  # no float drift left behind
            self.held_s, self.held_bytes = 0.0, 0
        return True


@dataclass(frozen=True)
class Progress:
    """A worker's report on one request: the layer it reached, the seconds it spent, whether the
    request is finished (answered by the worker, ok or failed), and the layer it started from here
    (below the batch's `from_layer` when its saved state was in another DC or lost: computed again;
    None: as the batch said)."""

    id: str
    reached_layer: int
    seconds: float
    finished: bool = False
    started_layer: int | None = None
    answered_at: float | None = None  # when the worker answered it, if finished (None: not said)


@dataclass
class InFlight:
    worker: str
    ids: tuple[str, ...]
    report_by: float
    #: its report was late once, from a worker still heard from, and the wait extended once
    extended: bool = False


@dataclass
class Counts:
    requests: int = 0
    overloaded: int = 0  # refused at arrival (`Admission`)
    moved: int = 0  # handed to the decoder: the bubbles could not compute it by its objective
    batches: int = 0
    done: int = 0
    expired: int = 0
    unavailable: int = 0
    requeued: int = 0
    #: prompt layers the workers ran, and of those the ones run again because the partial state
    #: they would have resumed from was in another datacenter or lost
    layers_run: int = 0
    layers_recomputed: int = 0
