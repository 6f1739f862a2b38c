"""The front door's choice of datacenter, where a dispatcher serves each (`bubbletea.dispatch: per_dc`).

Each datacenter's dispatcher publishes its `DcSnapshot` with its readiness verdict
(`keys.dc_snapshot_key`, every `dc_routing.publish_every_s`: its tick, 50 device ms, and at least
every readiness interval); the front door reads them as often
(`read`, beside its readiness gate) into a `dc_routing.Router`, and routes each request it accepts
on it (`place`): the accept script queues it on that datacenter's request stream. The policy is the
simulator's (`sim/front_door.py`), with one difference: where no datacenter is predicted to meet a
request's objective, or none has come round once, the simulator's front door applies placement's
rule itself, while the live one sends the request to the least queued datacenter that can serve
(`Router.judged_by`) and lets its dispatcher apply the rule with its own, current state (the
decoder, or a 429), as the one dispatcher of a run does for every request. Before any snapshot is
read, the datacenters are taken in turn.

The request's predicted cost is the cost model's before any report (`PrefillCostModel.scaled`):
the front door hears no reports. Every datacenter is weighed with the same cost, so the choice
between them does not depend on it; the objective's check does (a dispatcher's learned model may
predict shorter or longer), and the chosen dispatcher judges the request again in any case.

Tested by: tests/unit/test_dispatch_per_dc.py, tests/integration/test_front_door_routing.py,
tests/e2e/test_dispatch_per_dc.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.bus.connection import Client
from shared.policies.dc_routing import DcSnapshot, Route, Router
from shared.policies.prefill_cost import PrefillCostModel
from shared.runtime.logs import get_logger
from shared.wire import PrefillRequest, keys

log = get_logger(__name__)


@dataclass
class DcRouting:
    """One front door's routing across `dcs` (`pipeline_plan.dispatch_dcs`)."""

    run: str
    dcs: list[str]
    cost: PrefillCostModel
    router: Router = field(default_factory=Router)
    _turn: int = 0
    _unreadable: set[str] = field(default_factory=set)  # logged once until readable again

    async def read(self, r: Client) -> None:
        """Read every datacenter's snapshot into the router (Redis errors are the caller's)."""
        async with r.pipeline(transaction=False) as pipe:
            for dc in self.dcs:
                pipe.get(keys.dc_snapshot_key(self.run, dc))
            raws: list[Any] = await pipe.execute()
        for dc, raw in zip(self.dcs, raws, strict=True):
            if raw is None:
                continue
            try:
                snap = msgspec.json.decode(raw, type=DcSnapshot)
            except msgspec.DecodeError as exc:
                if dc not in self._unreadable:
                    log.warning("a datacenter's snapshot is unreadable: not routed on", dc=dc, error=repr(exc))
                self._unreadable.add(dc)
                continue
            self._unreadable.discard(dc)
            self.router.published(snap)

    def place(self, req: PrefillRequest, now: float | None = None) -> tuple[str, Route]:
        """The datacenter whose request stream `req` goes on, and the route that chose it (a route
        with no datacenter: the one that judges it, `Router.judged_by`, or the next in turn)."""
        now = time.time() if now is None else now
        objective_s = req.objective - now if req.objective is not None else None
        route = self.router.route(
            self.cost.predict(len(req.tokens)), objective_s, now, may_move=req.may_move, decoder_s=req.decoder_s
        )
        dc = route.dc or self.router.judged_by(now)
        if dc is None:
            dc = self.dcs[self._turn % len(self.dcs)]
            self._turn += 1
        return dc, route
