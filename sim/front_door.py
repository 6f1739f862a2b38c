"""The simulator's front door: requests arrive from the load, pass its admission limit and
placement, and go to a dispatcher over the bus.

With one dispatcher every request goes to it. With one per datacenter (`DispatchMode.PER_DC`) the
front door routes each by `dc_routing.Router`, on the snapshots the dispatchers publish: a
snapshot lands on the bus (Redis) a hop after its publish, and the front door reads the bus every
`PUBLISH_EVERY_S`, half an interval out of phase with the publishes, the read a hop long, as the
live front door polls the dispatchers' snapshot keys. So the routing works on the staleness the
live one would: half an interval and two hops at the least, one and a half at the most (the live
front door reads as often as they are published: `dc_routing.publish_every_s`). Where no
DC is predicted to meet a request's objective, or none has come round once, placement's rule
applies (`prompt_placement`): the decoder where it may take prompts (`auto`), a refusal
(`OVERLOADED`) otherwise. Before the first snapshot is read, as the live front door accepts requests
while no dispatcher's verdict is known, requests go to the DCs in turn.

A request's predicted cost is the spec's prefill profile's (`PrefillProfile.request_s`): the spec
is read by the front door too; its dispatcher predicts with the cost model it learned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from shared.policies.dc_routing import PUBLISH_EVERY_S, STALE_AFTER_S, DcSnapshot, Route, Router, RouteWhy
from shared.policies.dispatch_inputs import Request
from shared.policies.events import EventQueue
from shared.policies.prompt_placement import Mode
from shared.wire.status import FailureReason
from sim.dispatchers import ALL, Dispatchers, DispatchMode
from sim.executor import SimRequest
from sim.serving_config import ServingConfig


class Admitted(Protocol):
    """What the front door counts (`sim.serving.ServingStats`)."""

    sent: int
    rejected: int
    offered_tokens: int
    moved: int
    moved_tokens: int
    failed: Counter[str]
    routed: Counter[str]


class FrontDoor:
    """The run's front door: `start` begins the arrivals (and, per DC, the reads of the snapshots)."""

    def __init__(
        self,
        cfg: ServingConfig,
        dispatch: Dispatchers,
        queue: EventQueue,
        arrivals: Iterator[tuple[float, int]],
        stats: Admitted,
    ) -> None:
        self.cfg, self.dispatch, self.q, self._arrivals, self.stats = cfg, dispatch, queue, arrivals, stats
        self.router = Router(stale_after_s=STALE_AFTER_S * cfg.snapshot_every_s / PUBLISH_EVERY_S)
        self._board: dict[str, DcSnapshot] = {}  # the snapshots on the bus, by DC (the readiness keys)
        self._dcs = sorted(dispatch.states)
        self._seq = 0

    def start(self) -> None:
        self._next_arrival()
        if self.dispatch.mode is DispatchMode.PER_DC:
            self.dispatch.post = self.posted
            self.q.at(self.cfg.snapshot_every_s / 2, self._poll)

    # --- the snapshots -------------------------------------------------------------------------

    def posted(self, now: float, snaps: list[DcSnapshot]) -> None:
        """Snapshots landed on the bus (each DC's replaces its last)."""
        for s in snaps:
            self._board[s.dc] = s

    def _poll(self, now: float, _: object = None) -> None:
        self.q.at(now + self.cfg.bus_s, self._read, list(self._board.values()))
        self.q.at(now + self.cfg.snapshot_every_s, self._poll)

    def _read(self, now: float, snaps: list[DcSnapshot]) -> None:
        for s in snaps:
            self.router.published(s)

    # --- requests ------------------------------------------------------------------------------

    def _next_arrival(self) -> None:
        nxt = next(self._arrivals, None)
        if nxt is not None:
            self.q.at(max(nxt[0], self.q.now), self._on_arrival, nxt[1])

    def _on_arrival(self, now: float, tokens: int) -> None:
        self.stats.sent += 1
        self.stats.offered_tokens += tokens
        self._seq += 1
        if self.cfg.placement is Mode.DECODER:  # the bubbles are not used
            self._to_decoder(tokens)
        elif self.dispatch.known >= self.cfg.max_queue:
            self.stats.rejected += 1
        else:
            rid = f"q{self._seq}"
            dc = self._route(tokens, now)
            if dc is not None:
                req = Request(
                    id=rid,
                    tokens=tokens,
                    arrival=now,
                    kv_bytes=self.cfg.kv_bytes(tokens),
                    deadline=now + self.cfg.timeout_s,
                    payload=SimRequest(rid, tokens, now, "" if dc == ALL else dc),
                    objective=now + self.cfg.objective_s if self.cfg.objective_s is not None else None,
                    may_move=self.cfg.placement is Mode.AUTO,
                )
                self.q.at(now + self.cfg.bus_s, self.dispatch.on_request, (dc, req))
        self._next_arrival()

    def _route(self, tokens: int, now: float) -> str | None:
        """The dispatcher a request goes to (its DC, or `ALL`); None: placed on the decoder or
        refused here (placement's rule, where no DC is predicted to meet its objective)."""
        if self.dispatch.mode is DispatchMode.ONE:
            return ALL
        may_move = self.cfg.placement is Mode.AUTO
        r: Route = self.router.route(
            self.cfg.profile.request_s(tokens, self.cfg.layers), self.cfg.objective_s, now, may_move=may_move
        )
        self.stats.routed[r.why.value] += 1
        if r.dc is not None:
            return r.dc
        if r.why is RouteWhy.NONE_FRESH:  # no verdict known yet: accepted, the DCs in turn
            return self._dcs[self._seq % len(self._dcs)]
        if may_move:
            self._to_decoder(tokens)
        else:
            self.stats.failed[FailureReason.OVERLOADED.value] += 1
        return None

    def _to_decoder(self, tokens: int) -> None:
        self.stats.moved += 1
        self.stats.moved_tokens += tokens
