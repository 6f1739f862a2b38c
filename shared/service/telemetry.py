"""Prometheus metrics for the bus services: a tiny `/metrics` HTTP endpoint and the stream gauges.

The front door serves ``/metrics`` from its own app. The bus services (dispatcher, stage workers,
WAN broker) have no HTTP app, so each runs a `MetricsServer` (aiohttp) on
``settings.metrics_host:metrics_port`` and advertises the URL it bound in its heartbeat
(``metrics_url``). Each service keeps its metrics in its own `CollectorRegistry` (no global state).

* `MetricsServer` serves ``GET /metrics`` from a registry. An optional async ``refresh()`` runs
  before each scrape, for gauges read at scrape time (stream lag from Redis, link utilisation);
  a transient Redis error or a slow Redis does not fail the scrape: those gauges keep their last
  values and the rest is served.
* `StreamMetrics` registers the bus gauges every service shares: per consumed stream and group the
  entries not yet delivered (lag) and delivered but not acked (pending), the entries this process's
  consumers dead-lettered, and the length of the dead-letter stream.

Naming follows vLLM's habits with our prefix: ``bubbletea:<what>_<unit>``, counters end in
``_total`` (prometheus_client appends it), and metrics about the served model carry ``model_name``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.bus.connection import TRANSIENT_ERRORS
from shared.runtime.auth import bearer_ok
from shared.runtime.logs import get_logger
from shared.wire import keys

if TYPE_CHECKING:
    from shared.bus.consumer import Consumer

log = get_logger(__name__)

#: A scrape waits at most this long for `refresh` (Prometheus' own scrape timeout defaults to 10 s).
REFRESH_TIMEOUT_S = 2.0
#: Where XINFO GROUPS gives no lag (Redis < 7, or 7 after deletions), the undelivered entries are
#: counted with XRANGE, up to this many (the gauge then reads "at least this many").
LAG_SCAN_LIMIT = 1000

#: Histogram buckets (seconds) shared by the services.
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SLOW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

Refresh = Callable[[], Awaitable[None]]
#: What a refresh may fail with and the scrape still be served: Redis away, or too slow.
REFRESH_ERRORS: tuple[type[Exception], ...] = (*TRANSIENT_ERRORS, TimeoutError)


class MetricsServer:
    """``GET /metrics`` for one registry, on aiohttp. Port 0 binds any free port (`start` returns
    the real URL); port None serves nothing (`start` returns "")."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str = "127.0.0.1",
        port: int | None = 0,
        *,
        refresh: Refresh | None = None,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: scrapes must send it as a bearer token (`BUBBLETEA_METRICS_AUTH=on`)."""
        self.registry, self.host, self.port, self.refresh = registry, host, port, refresh
        self.api_key = api_key
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._refresh_failing = False

    async def start(self) -> str:
        """Bind and serve; the URL actually bound ("" when the endpoint is off)."""
        if self.port is None:
            log.info("metrics endpoint off")
            return ""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)  # a scrape every few seconds is not news
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        port = runner.addresses[0][1]  # the real port when 0 was asked
        self.url = f"http://{_url_host(self.host)}:{port}/metrics"
        log.info("metrics at", url=self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.api_key and not bearer_ok(request.headers.get("Authorization", ""), self.api_key):
            error = {"message": "missing or wrong API key: send 'Authorization: Bearer <key>'"}
            return web.json_response({"error": {**error, "type": "authentication_error"}}, status=401)
        if self.refresh is not None:
            await self._refresh()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _refresh(self) -> None:
        assert self.refresh is not None
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT_S):
                await self.refresh()
        except REFRESH_ERRORS as exc:
            if not self._refresh_failing:  # once per outage, not once per scrape
                log.warning("metrics refresh failed; gauges read from Redis keep their last values", error=repr(exc))
            self._refresh_failing = True
            return
        if self._refresh_failing:
            log.info("metrics refresh works again")
        self._refresh_failing = False


def _url_host(host: str) -> str:
    """A host to put in the advertised URL: a wildcard bind is reachable at this host's name."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


class StreamMetrics:
    """The bus gauges of one service, for the consumers it was given (`add`), read by `refresh`."""

    def __init__(self, registry: CollectorRegistry, consumers: Iterable[Consumer] = ()) -> None:
        self.consumers: list[Consumer] = []
        self.lag = Gauge(
            "bubbletea:stream_lag",
            "Entries of a stream not yet delivered to a consumer group (XINFO GROUPS lag; counted with "
            f"XRANGE, up to {LAG_SCAN_LIMIT}, where Redis gives none), read at scrape time.",
            ["stream", "group"],
            registry=registry,
        )
        self.pending = Gauge(
            "bubbletea:stream_pending",
            "Entries of a stream delivered to a consumer group and not acked yet (being handled, held, or "
            "left by a dead consumer), read at scrape time.",
            ["stream", "group"],
            registry=registry,
        )
        self.dead_lettered = Gauge(
            "bubbletea:dead_lettered",
            "Entries of a stream this process's consumers moved to the dead-letter stream since they started "
            "(undecodable, of a kind the stream does not take, or failed too often); only grows.",
            ["stream"],
            registry=registry,
        )
        self.dead_letter_length = Gauge(
            "bubbletea:dead_letter_stream_length",
            "Entries in the dead-letter streams of the streams this process consumes (its run's "
            "bt:{<run>}:dead, every service's of the run), read at scrape time.",
            registry=registry,
        )
        self.add(*consumers)

    def add(self, *consumers: Consumer) -> None:
        self.consumers.extend(consumers)
        for c in consumers:  # the series exist from the start, at 0
            self.lag.labels(c.stream, c.group)
            self.pending.labels(c.stream, c.group)
            self.dead_lettered.labels(c.stream)

    async def refresh(self, redis: Redis) -> None:
        """Read the gauges: the dead-letter counts from the consumers, the rest from Redis."""
        dead: dict[str, int] = {}
        for c in self.consumers:
            dead[c.stream] = dead.get(c.stream, 0) + c.stats.dead_lettered
        for stream, n in dead.items():
            self.dead_lettered.labels(stream).set(n)
        for stream, group in dict.fromkeys((c.stream, c.group) for c in self.consumers):
            lag, pending = await group_backlog(redis, stream, group)
            self.lag.labels(stream, group).set(lag)
            self.pending.labels(stream, group).set(pending)
        dead_streams = dict.fromkeys(keys.dead_letter_stream(c.stream) for c in self.consumers)
        self.dead_letter_length.set(sum([await redis.xlen(s) for s in dead_streams]))


async def group_backlog(redis: Redis, stream: str, group: str) -> tuple[int, int]:
    """(lag, pending) of `group` on `stream`: entries not delivered to it yet, and delivered but not
    acked. (0, 0) while the stream or the group does not exist (e.g. Redis restarted empty)."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such stream
        return 0, 0
    info = next((g for g in groups if _text(g.get("name")) == group), None)
    if info is None:
        return 0, 0
    pending = int(info.get("pending") or 0)
    lag = info.get("lag")
    if isinstance(lag, int):
        return lag, pending
    last = _text(info.get("last-delivered-id")) or "0-0"
    after = await redis.xrange(stream, f"({last}", "+", count=LAG_SCAN_LIMIT)
    return len(after or ()), pending


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
