"""The serving plane on the virtual clock: the front door, the dispatchers and every worker's fill executor.

The dispatchers are the live one's policy object, `DispatchState`, configured from the spec as
services/dispatcher does it, fed the same inputs (requests, bubble starts and ends, reports, a
50 ms timer) and executed the same way: batches go to the worker's executor, failures are counted
by reason (`sim.dispatchers`). There is one for the run (`DispatchMode.ONE`, as live today) or one
per datacenter (`PER_DC`), to which the front door routes each request (`sim.front_door`). Every
message crosses the bus with a fixed latency (`bus_s`), as on Redis: bubble events and reports to
the dispatcher, batches to the worker, answers to the front door. A request's time to first token
runs from its arrival at the front door to its answer getting back there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from shared.policies.decisions import Batch
from shared.policies.dispatch_inputs import BubbleClosed, BubbleOpened, Progress, WorkerReady
from shared.policies.events import EventQueue
from shared.policies.fill import FillQueue
from shared.wire.status import FailureReason
from sim.dispatchers import Dispatchers
from sim.executor import Executor, SimRequest
from sim.front_door import FrontDoor
from sim.serving_config import ServingConfig


@dataclass
class ServingStats:
    sent: int = 0  # requests the load offered
    rejected: int = 0  # refused by admission control (the queue was full)
    ttfts_s: list[float] = field(default_factory=list)  # one per answered request
    tokens: int = 0  # prompt tokens answered (in the bubbles)
    offered_tokens: int = 0  # prompt tokens of every request sent
    moved: int = 0  # requests placed on the decoder (`prompt_placement`): at arrival or when their margin ran out
    moved_tokens: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # by FailureReason
    batches: int = 0
    returned: int = 0  # batches handed back unrun
    #: prompt layers run, and of those the ones run again (their saved state was in another DC)
    layers_run: int = 0
    layers_recomputed: int = 0
    #: prefill runs' seconds, and of them the seconds that computed prompt tokens (blocks' fixed parts apart)
    prefill_s: float = 0.0
    worked_s: float = 0.0
    #: bubbles' rests the fit rule left empty (seconds, summed)
    refused_s: float = 0.0
    #: per bubble that ran prefill: how long training waited past its input's arrival (seconds)
    overruns_s: list[float] = field(default_factory=list)
    #: per DC dispatch: how the front door routed requests (`dc_routing.RouteWhy`), and the answers by DC
    routed: Counter[str] = field(default_factory=Counter)
    answered_in: Counter[str] = field(default_factory=Counter)

    @property
    def worked_share(self) -> float | None:
        """Of the prefill time, the share that computed prompt tokens (None: no prefill ran)."""
        return self.worked_s / self.prefill_s if self.prefill_s > 0 else None

    @property
    def recomputed_share(self) -> float | None:
        return self.layers_recomputed / self.layers_run if self.layers_run else None

    @property
    def bubble_token_share(self) -> float | None:
        """Of the prompt tokens sent, the share computed in the bubbles (None before any was sent)."""
        return self.tokens / self.offered_tokens if self.offered_tokens else None


class Serving:
    """The `Guest` of `shared.policies.pipeline_run.PipelineRun`."""

    def __init__(self, cfg: ServingConfig, queue: EventQueue, arrivals: Iterator[tuple[float, int]]) -> None:
        self.cfg, self.q = cfg, queue
        self.stats = ServingStats()
        self.dispatch = Dispatchers(
            cfg.dispatch, cfg.workers, cfg.datacenters, cfg.bubbletea, cfg.layers, queue, cfg.bus_s, self.stats
        )
        self.dispatch.every_s = cfg.snapshot_every_s
        saved_in: dict[str, str] = {}  # request id -> DC of the state it resumes from
        self.executors = [
            Executor(
                w,
                cfg.layers,
                FillQueue.from_spec(cfg.bubbletea),
                cfg.profile,
                queue,
                self,
                cfg.datacenters[w],
                saved_in,
            )
            for w in range(len(cfg.workers))
        ]
        self.dispatch.executors = self.executors
        self.front = FrontDoor(cfg, self.dispatch, queue, arrivals, self.stats)
        #: per worker: when its open bubble started, and when its awaited input arrived
        self._opened: dict[int, float] = {}
        self._input_at: dict[int, float] = {}
        #: (worker, iteration, start, end) of each prefill run; `iteration_of` is training's
        self.spans: list[tuple[int, int, float, float]] = []
        self.iteration_of: Callable[[int], int] = lambda worker: 0

    def start(self) -> None:
        self.front.start()
        self.dispatch.start()

    # --- the guest of training -------------------------------------------------------------

    def bubble_start(
        self, worker: int, iteration: int, position: int, predicted_s: float, now: float, room_s: float | None = None
    ) -> None:
        ex = self.executors[worker]
        ex.open(now, room_s)
        self._opened[worker] = now
        opened = BubbleOpened(
            worker=self.cfg.workers[worker],
            address=self.cfg.workers[worker],
            predicted_s=predicted_s,
            free_memory=self.cfg.free_memory,
            started=now,
            tag=(iteration, position),
            dc=self.cfg.datacenters[worker],
            queued_s=ex.queue.queued_s,
        )
        self.q.at(now + self.cfg.bus_s, self.dispatch.on_bubble_start, opened)

    def joined(self, worker: int, typical_s: float, now: float) -> None:
        ready = WorkerReady(
            worker=self.cfg.workers[worker],
            address=self.cfg.workers[worker],
            typical_s=typical_s,
            free_memory=self.cfg.free_memory,
            at=now,
            dc=self.cfg.datacenters[worker],
        )
        self.q.at(now + self.cfg.bus_s, self.dispatch.on_joined, ready)

    def input_arrived(self, worker: int, now: float) -> float:
        self._input_at[worker] = now
        return self.executors[worker].input_arrived(now)

    def bubble_end(self, worker: int, iteration: int, position: int, now: float) -> None:
        ex = self.executors[worker]
        input_at = self._input_at.pop(worker, now)
        refused = ex.refused_s(input_at)  # the rest the fit rule left empty
        finished = ex.close(now)
        if ex.ran_in_bubble:
            self.stats.overruns_s.append(max(0.0, now - input_at))
        self.stats.refused_s += refused
        start = self._opened.pop(worker, now)
        actual = max(0.0, input_at - start)  # start to the input's arrival
        closed = BubbleClosed(self.cfg.workers[worker], (iteration, position), actual, finished, refused)
        self.q.at(now + self.cfg.bus_s, self.dispatch.on_bubble_end, closed)

    # --- the host of the executors ---------------------------------------------------------

    def report(self, worker: int, batch: Batch[SimRequest], progress: list[Progress], now: float) -> None:
        if not any(p.seconds > 0 for p in progress):
            self.stats.returned += 1
        self.q.at(now + self.cfg.bus_s, self.dispatch.on_report, (batch.batch_id, self.cfg.workers[worker], progress))

    def answered(self, requests: list[SimRequest], now: float) -> None:
        back = now + self.cfg.bus_s  # the answer's trip to the front door
        for r in requests:
            if r.id in self.dispatch.moved:  # moved to the decoder while held on this worker: that was its answer
                continue
            self.stats.ttfts_s.append(back - r.arrival)
            self.stats.tokens += r.tokens
            if r.dc:
                self.stats.answered_in[r.dc] += 1

    def late(self, requests: list[SimRequest], now: float) -> None:
        """Failed on a worker that came to them past their due (`fill.late_on_worker`)."""
        for r in requests:
            if r.id not in self.dispatch.moved:  # moved to the decoder while held: that was its answer
                self.stats.failed[FailureReason.DEADLINE.value] += 1

    def prefill_span(self, worker: int, start: float, end: float, worked_s: float) -> None:
        self.spans.append((worker, self.iteration_of(worker), start, end))
        self.stats.prefill_s += end - start
        self.stats.worked_s += worked_s
