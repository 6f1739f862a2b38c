"""Prometheus metrics of the WAN broker, in its own registry.

Every link metric carries the run (`run`) and the directed link (`src_dc`, `dst_dc`). Each link
driver records a delivered transfer in one call; utilisation and transfers in flight are read from
the drivers at scrape time (`refresh`), as the broker's `LinkReport` reads them.

Tested by: tests/integration/test_service_metrics.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector
from redis.asyncio import Redis

from shared.service.telemetry import SLOW_BUCKETS, StreamMetrics

LINK = ["run", "src_dc", "dst_dc"]


class Link(Protocol):
    def stats(self) -> dict[str, float]: ...


class BrokerMetrics:
    def __init__(self, run: str) -> None:
        self.run = run
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.streams = StreamMetrics(r)
        self._utilization = Gauge(
            "bubbletea:wan_link_utilization",
            "Busy fraction of a directed WAN link since the broker started: time with at least one byte "
            "on the wire / time elapsed (the LinkReport's utilization). Set at scrape time.",
            LINK,
            registry=r,
        )
        self._in_flight = Gauge(
            "bubbletea:wan_transfers_in_flight",
            "Transfers on a directed WAN link that have not finished sending (queued or transmitting). "
            "Set at scrape time.",
            LINK,
            registry=r,
        )
        self._bytes = Counter(
            "bubbletea:wan_bytes", "Bytes of the transfers delivered over a directed WAN link.", LINK, registry=r
        )
        self._transfers = Counter(
            "bubbletea:wan_transfers", "Transfers delivered over a directed WAN link.", LINK, registry=r
        )
        self._seconds = Histogram(
            "bubbletea:wan_transfer_seconds",
            "Per delivered transfer: from entering the emulated wire (the sender's send time) to its "
            "payload appended to the receiver's inbox, seconds (queueing, transmission and latency).",
            LINK,
            buckets=SLOW_BUCKETS,
            registry=r,
        )

    def link(self, src: str, dst: str) -> None:
        """A link exists: its series exist from the start, at 0."""
        for m in (self._utilization, self._in_flight, self._bytes, self._transfers, self._seconds):
            m.labels(self.run, src, dst)

    def delivered(self, src: str, dst: str, nbytes: int, seconds: float) -> None:
        self._bytes.labels(self.run, src, dst).inc(nbytes)
        self._transfers.labels(self.run, src, dst).inc()
        self._seconds.labels(self.run, src, dst).observe(max(0.0, seconds))

    async def refresh(self, redis: Redis, links: Mapping[tuple[str, str], Link]) -> None:
        for (src, dst), link in links.items():
            st = link.stats()
            self._utilization.labels(self.run, src, dst).set(st["utilization"])
            self._in_flight.labels(self.run, src, dst).set(st["in_flight"])
        await self.streams.refresh(redis)
