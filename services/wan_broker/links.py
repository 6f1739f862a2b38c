"""One directed WAN link driven by the real clock: the `LinkSharing` policy decides, this delivers.

Path kept open for real WANs: today the broker holds the payload and appends it to the receiver's
inbox at the emulated arrival time. Over a real WAN the same decisions become grants: the broker
would tell the sender "transmit now" when the policy starts a transfer, and the sender would report
"done" when its last byte is acknowledged; the policy object is unchanged.

Tested by: tests/integration/test_wan_broker.py.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

from services.wan_broker.metrics import BrokerMetrics
from shared.bus import Bus
from shared.figures.percentiles import percentile
from shared.policies.wan import LinkModel, LinkSharing, Sent
from shared.runtime.logs import get_logger
from shared.runtime.timing import SPIN_S, sleep_until
from shared.wire import FIELD, Transfer

log = get_logger(__name__)

#: How far the policy's clock stays behind the real one, at most. Transfers sent together reach
#: the broker one after the other, a bus hop and a read apart; had the first one's submission moved
#: the link's clock to the present, the next would start that much late on the emulated wire. Kept
#: this far back, a transfer read up to this long after it was sent still starts at its send time.
#: Deliveries stay on time: a transfer's last byte leaves at `tx_end`, which the policy learns
#: `settle` later, and it arrives `latency` after `tx_end`; `settle` leaves its delivery the lead
#: of a precise sleep (`shared.runtime.timing.SPIN_S`), so it is at most the latency minus that.
SETTLE_S = 0.005


@dataclass
class _Pending:
    msg: Transfer
    done: asyncio.Future[None]
    started: float = 0.0  # when it entered the wire, on the link's clock


class LinkDriver:
    """Feeds transfers to the link policy on the loop clock and delivers them on time."""

    def __init__(
        self, bus: Bus, src: str, dst: str, model: LinkModel, policy: str, metrics: BrokerMetrics | None = None
    ) -> None:
        self.bus, self.src, self.dst, self.model, self.metrics = bus, src, dst, model, metrics
        if metrics is not None:
            metrics.link(src, dst)
        self.loop = asyncio.get_running_loop()
        self.origin = time.monotonic()  # not loop.time(): uvloop's clock has millisecond steps
        self.sharing = LinkSharing(model, policy)
        self.settle = max(0.0, min(SETTLE_S, model.latency - SPIN_S))
        self.pending: dict[str, _Pending] = {}
        #: Delivery time minus the policy's arrival time (ms), recent deliveries.
        self.late_ms: collections.deque[float] = collections.deque(maxlen=10_000)
        #: The policy's schedule of recent deliveries, in delivery order: what each was modelled to
        #: be (start, end of sending, arrival), so a test can hold the live broker to the policy
        #: exactly rather than to wall-clock windows that a busy machine stretches. A delivery
        #: whose append fails is resubmitted, and then recorded again.
        self.delivered: collections.deque[Sent] = collections.deque(maxlen=10_000)
        self._wake = asyncio.Event()
        self._deliveries: set[asyncio.Task[None]] = set()
        self._task = asyncio.create_task(self._run(), name=f"link:{src}->{dst}")

    def now(self) -> float:
        return time.monotonic() - self.origin

    async def carry(self, msg: Transfer) -> None:
        """Submit a transfer; return once its payload has been delivered (so the caller acks then)."""
        if msg.transfer_id in self.pending:  # a redelivery of a transfer already under way
            await asyncio.shield(self.pending[msg.transfer_id].done)
            return
        done: asyncio.Future[None] = self.loop.create_future()
        self.pending[msg.transfer_id] = p = _Pending(msg, done, self._start_time(msg))
        self.sharing.submit(msg.transfer_id, msg.nbytes, msg.priority, p.started)
        self._wake.set()
        await asyncio.shield(done)

    def _start_time(self, msg: Transfer) -> float:
        """When the transfer entered the wire on the link's clock: the sender's send time (the bus
        hop to the broker is not part of the emulated WAN), but never before the policy's clock
        (its past is settled; it runs `settle` behind the present) and never in the future (clock
        skew)."""
        now = self.now()
        if msg.sent_at <= 0:
            return now
        sent = now - max(0.0, time.time() - msg.sent_at)
        return min(now, max(sent, self.sharing.now))

    async def expire(self) -> None:
        """Nothing to reclaim: the link model releases every transfer itself."""

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, *self._deliveries, return_exceptions=True)

    def stats(self) -> dict[str, float]:
        elapsed = max(self.now(), 1e-9)
        return {
            "utilization": self.sharing.stats.busy_s / elapsed,
            "bytes_sent": self.sharing.stats.bytes_sent,
            "transfers": self.sharing.stats.transfers,
            "in_flight": self.sharing.in_flight(),
            "late_p99_ms": percentile(self.late_ms, 99) or 0.0,
            "busy_s": self.sharing.stats.busy_s,
        }

    async def _run(self) -> None:
        while True:
            for sent in self.sharing.advance(max(self.sharing.now, self.now() - self.settle)):
                task = asyncio.create_task(self._deliver(sent))
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)
            nxt = self.sharing.next_tx_end()
            self._wake.clear()
            if nxt is None:
                await self._wake.wait()
            else:
                await sleep_until(self.origin + nxt + self.settle, wake=self._wake)

    async def _deliver(self, sent: Sent) -> None:
        await sleep_until(self.origin + sent.arrival)
        p = self.pending.pop(sent.id)
        self.late_ms.append((self.now() - sent.arrival) * 1000)
        self.delivered.append(sent)  # before the append to the inbox: whoever reads it finds this
        try:
            await self.bus.redis.xadd(p.msg.deliver_to, {FIELD: p.msg.payload})
        except Exception as exc:  # the request stays unacked and is redelivered, then resubmitted
            p.done.set_exception(exc)
            return
        if self.metrics is not None:
            self.metrics.delivered(self.src, self.dst, p.msg.nbytes, self.now() - p.started)
        p.done.set_result(None)
