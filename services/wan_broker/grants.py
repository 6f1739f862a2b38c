"""One directed WAN link as slots (WAN modes `kernel` and `none`): the broker grants, workers move
the bytes themselves on the data plane and report the end.

The decisions are the pure `SlotArbiter`'s; this shell stamps them with the link's clock, publishes
each `SlotGrant` to the requesting worker's inbox, logs why, and keeps each request's bus entry
pending (`HOLD`) until its `SlotDone`, so a broker that dies forgets nothing: its successor
re-reads the requests still open and grants them again (a worker ignores a grant it already had).
A grant whose end never comes is reclaimed by the arbiter's `expire`, run with the link reports.

Tested by: tests/integration/test_wan_broker.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.wan_broker.metrics import BrokerMetrics
from shared.bus import Bus
from shared.policies.slots import Grant, SlotArbiter
from shared.policies.wan import LinkModel
from shared.runtime.logs import get_logger
from shared.wire import SlotDone, SlotGrant, SlotRequest

log = get_logger(__name__)


@dataclass
class _Open:
    request: SlotRequest
    entry: str  # the request's bus entry, acked once the transfer is done
    granted_at: float = 0.0
    arrived: float = 0.0  # time.time() when the broker read the request (its bus hop ends)


class SlotDriver:
    def __init__(
        self,
        bus: Bus,
        src: str,
        dst: str,
        model: LinkModel,
        policy: str,
        release: Callable[[str], None],
        metrics: BrokerMetrics | None = None,
    ) -> None:
        self.bus, self.src, self.dst, self.metrics, self.release = bus, src, dst, metrics, release
        if metrics is not None:
            metrics.link(src, dst)
        self.arbiter = SlotArbiter(model, policy)
        self.origin = time.monotonic()
        self.open: dict[str, _Open] = {}
        self.bytes_sent = 0
        self.transfers = 0
        self.busy_s = 0.0  # the union of the transfers' times on the wire, as their receivers measured
        self._busy_until = 0.0

    def now(self) -> float:
        return time.monotonic() - self.origin

    async def on_request(self, req: SlotRequest, entry: str) -> None:
        if req.transfer_id not in self.open:
            self.open[req.transfer_id] = _Open(req, entry, arrived=time.time())
        else:  # redelivered: ack the newest copy of the entry when done
            self.open[req.transfer_id].entry = entry
        await self._publish(self.arbiter.request(req.transfer_id, req.nbytes, req.priority, self.now()))

    async def on_done(self, done: SlotDone) -> None:
        o = self.open.pop(done.transfer_id, None)
        grants = self.arbiter.done(done.transfer_id, self.now())
        if o is not None:
            now = self.now()
            seconds = done.seconds if done.seconds > 0 else (time.monotonic() - o.granted_at if o.granted_at else 0.0)
            start = now - seconds  # on the wire [start, now]: add what the busy union lacks
            self.busy_s += max(0.0, now - max(start, self._busy_until))
            self._busy_until = max(self._busy_until, now)
            self.bytes_sent += o.request.nbytes
            self.transfers += 1
            log.debug("slot done", link=f"{self.src}->{self.dst}", transfer=done.transfer_id, wire_ms=seconds * 1000)
            if self.metrics is not None:
                self.metrics.delivered(self.src, self.dst, o.request.nbytes, seconds)
            self.release(o.entry)
        await self._publish(grants)

    async def expire(self) -> None:
        """Reclaim the grants whose `SlotDone` never came (a receiver died after the bytes left)."""
        expiry = self.arbiter.expire(self.now())
        for g in expiry.reclaimed:
            o = self.open.pop(g.id, None)
            log.warning("slot reclaimed", link=f"{self.src}->{self.dst}", transfer=g.id, why=g.why)
            if o is not None:
                self.release(o.entry)
        await self._publish(expiry.grants)

    async def _publish(self, grants: list[Grant]) -> None:
        for g in grants:
            o = self.open.get(g.id)
            if o is None:
                continue
            o.granted_at = time.monotonic()
            req = o.request
            log.info(
                "slot granted",
                link=f"{self.src}->{self.dst}",
                transfer=g.id,
                bytes=req.nbytes,
                waited_ms=round((time.time() - req.sent_at) * 1000, 2) if req.sent_at else "-",
                # the request's own bus hop, worker to broker: the model's `SlotControl.request_s`
                hop_ms=round((o.arrived - req.sent_at) * 1000, 2) if req.sent_at and o.arrived else "-",
                why=g.why,
            )
            await self.bus.publish(req.reply_to, SlotGrant(run=req.run, transfer_id=g.id, why=g.why))

    def stats(self) -> dict[str, float]:
        elapsed = max(self.now(), 1e-9)
        return {
            "utilization": min(1.0, self.busy_s / elapsed),
            "bytes_sent": float(self.bytes_sent),
            "transfers": float(self.transfers),
            "in_flight": float(len(self.open)),
            "late_p99_ms": 0.0,
            "busy_s": self.busy_s,
        }

    async def close(self) -> None:
        return None
