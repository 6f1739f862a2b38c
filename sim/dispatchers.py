"""The simulator's dispatchers: one for the run (`one`, as services/dispatcher runs today) or one per
datacenter (`per_dc`, issue 66), each the live policy object `DispatchState`.

Each is fed what its live counterpart would read: the requests sent to it, and the bubble starts
and ends, joins and batch reports of its own workers (all of them with one dispatcher, its DC's with
one per DC), each a bus hop (`bus_s`) after it was sent; and a timer every `tick_s`. Its decisions
are executed the same way in both modes: batches go to their worker's executor a hop later,
failures are counted by reason, moves to the decoder noted. A dispatcher per DC knows only its DC's
workers, so a preempted prefill resumes only there: nothing is recomputed across DCs.

Per DC, every `dc_routing.PUBLISH_EVERY_S` (`ServingConfig.snapshot_every_s`) each dispatcher
publishes its snapshot (`DispatchState.snapshot`), which lands on the bus a hop later, where the
front door reads it (`sim.front_door`).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from shared.config.spec import BubbleTea
from shared.policies.dc_routing import PUBLISH_EVERY_S, DcSnapshot
from shared.policies.decisions import Decisions
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import BubbleClosed, BubbleOpened, Progress, Request, WorkerReady
from shared.policies.events import EventQueue
from sim.executor import Executor, SimRequest

#: The key of the one dispatcher's state (`DispatchMode.ONE`).
ALL = "*"


class DispatchMode(enum.StrEnum):
    """How many dispatchers serve the run (`ServingConfig.dispatch`)."""

    ONE = "one"  # one for every worker and the run's one request queue (the live system today)
    PER_DC = "per_dc"  # one per datacenter: its workers, its queue; the front door routes (`dc_routing`)


class Tally(Protocol):
    """What the dispatchers count (`sim.serving.ServingStats`)."""

    batches: int
    moved: int
    moved_tokens: int
    failed: Counter[str]
    layers_run: int
    layers_recomputed: int


class Dispatchers:
    """The dispatch set: a `DispatchState` per DC (or one, `ALL`), the workers' events routed to
    their DC's. `on_*` are the bus's deliveries (each a hop after it was sent)."""

    def __init__(
        self,
        mode: DispatchMode,
        workers: Sequence[str],
        datacenters: Sequence[str],
        bubbletea: BubbleTea,
        layers: int,
        queue: EventQueue,
        bus_s: float,
        stats: Tally,
    ) -> None:
        self.mode, self.q, self.bus_s, self.stats = mode, queue, bus_s, stats
        per_dc = mode is DispatchMode.PER_DC
        dcs = sorted(set(datacenters)) if per_dc else [ALL]
        self.states: dict[str, DispatchState[SimRequest]] = {
            dc: DispatchState[SimRequest].from_spec(bubbletea, layers, batch_prefix=f"b-{dc}" if per_dc else "b")
            for dc in dcs
        }
        #: each worker's dispatcher, by name
        self._of = {w: self.states[dc if per_dc else ALL] for w, dc in zip(workers, datacenters, strict=True)}
        self._index = {name: w for w, name in enumerate(workers)}
        self.executors: list[Executor] = []  # set by the host once they are built
        self.moved: set[str] = set()  # requests a dispatcher placed on the decoder (their answer), by id
        #: where a snapshot goes once on the bus (`FrontDoor.posted`); per DC only
        self.post: Callable[[float, list[DcSnapshot]], None] | None = None
        self.every_s = PUBLISH_EVERY_S  # how often they publish (per DC only)

    def start(self) -> None:
        tick_s = next(iter(self.states.values())).tick_s
        self.q.at(tick_s, self._tick)
        if self.mode is DispatchMode.PER_DC:
            self.q.at(0.0, self._publish)

    @property
    def known(self) -> int:
        """Requests the dispatchers hold (queued or on workers): what the front door's limit counts."""
        return sum(len(s.requests) for s in self.states.values())

    # --- the bus's deliveries ------------------------------------------------------------------

    def on_bubble_start(self, now: float, opened: BubbleOpened) -> None:
        self._execute(self._of[opened.worker].bubble_start(opened, now), now)

    def on_joined(self, now: float, ready: WorkerReady) -> None:
        self._execute(self._of[ready.worker].worker_joined(ready, now), now)

    def on_bubble_end(self, now: float, closed: BubbleClosed) -> None:
        self._execute(self._of[closed.worker].bubble_end(closed, now), now)

    def on_report(self, now: float, arg: tuple[str, str, list[Progress]]) -> None:
        batch_id, worker, progress = arg
        self._execute(self._of[worker].report(batch_id, worker, progress, now), now)
        counts = [s.counts for s in self.states.values()]
        self.stats.layers_run = sum(c.layers_run for c in counts)
        self.stats.layers_recomputed = sum(c.layers_recomputed for c in counts)

    def on_request(self, now: float, arg: tuple[str, Request[SimRequest]]) -> None:
        dc, req = arg
        self._execute(self.states[dc].add_request(req, now), now)

    # --- timers --------------------------------------------------------------------------------

    def _tick(self, now: float, _: object = None) -> None:
        tick_s = 0.0
        for state in self.states.values():
            self._execute(state.tick(now), now)
            tick_s = state.tick_s
        self.q.at(now + tick_s, self._tick)

    def _publish(self, now: float, _: object = None) -> None:
        """Every DC's snapshot (the simulator has no readiness gate: each can serve), on the bus a hop later."""
        if self.post is not None:
            snaps = [state.snapshot(dc, True, now) for dc, state in self.states.items()]
            self.q.at(now + self.bus_s, self.post, snaps)
        self.q.at(now + self.every_s, self._publish)

    def _execute(self, ds: Decisions[SimRequest], now: float) -> None:
        for batch in ds.batches:
            self.stats.batches += 1
            self.q.at(now + self.bus_s, self.executors[self._index[batch.worker]].on_batch, batch)
        for f in ds.failed:
            self.stats.failed[f.reason.value] += 1
        for m in ds.moved:  # computed by the decoder: not a failure
            self.moved.add(m.id)
            self.stats.moved += 1
            self.stats.moved_tokens += m.payload.tokens
