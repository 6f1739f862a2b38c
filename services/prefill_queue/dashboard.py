"""The run's live page: ``GET /dashboard`` (the page) and ``GET /dashboard/events`` (its data, as
server-sent events: a ``snapshot`` with the whole view, then an ``update`` every `UPDATE_EVERY_S`).

One reader of Redis per front door (`Hub`, started and stopped with the app) follows the run's
spans and events streams and looks at its leases, generation and dispatcher lease every
`LOOK_EVERY_S`; it keeps the last `WINDOW_S` seconds in a `shared.figures.dashboard.DashboardView`
and fans each update out to every open page. A page that does not keep up (`CLIENT_QUEUE` updates
behind) is dropped, never buffered without limit. With an API key set, the page and its events
take it as ``?key=...`` (a browser's EventSource cannot send a header) or the usual
``Authorization: Bearer`` header.

Tested by: tests/integration/test_dashboard.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from redis.asyncio import Redis

from services.prefill_queue.state import BUS, METRICS, SETTINGS
from services.prefill_queue.validation import BadRequest
from shared.bus.connection import TRANSIENT_ERRORS
from shared.control.leases import slot_name
from shared.figures.dashboard import OUTCOMES, DashboardView, worker_id
from shared.figures.dashboard_page import render
from shared.policies.pipeline_plan import dispatch_dcs
from shared.runtime.auth import bearer_ok
from shared.runtime.logs import get_logger
from shared.wire import FIELD, PrefillResult, WireError, decode, keys
from shared.wire.status import LeaseState

#: The page shows the last this many seconds (real) of the run.
WINDOW_S = 30.0
#: At most two updates a second: a page redraws smoothly, and the cost stays small (docs/benchmarks.md).
UPDATE_EVERY_S = 0.5
#: How often the leases, the generation and the dispatcher's lease are looked at (one round trip).
LOOK_EVERY_S = 1.0
#: A stream read blocks at most this long (the loop also looks at the keys between reads).
BLOCK_MS = 250
#: Updates a page may be behind before it is dropped (a few seconds: a slow page then reconnects).
CLIENT_QUEUE = 8
#: A write to a page that takes longer ends it: a page whose host vanished (no FIN) or that stopped
#: reading would otherwise hold its handler until TCP gives up (minutes).
WRITE_S = 10.0
#: Spans read back at start: the window of a large run (tens of workers, tens of spans a second each).
BACKLOG = 5_000
log = get_logger(__name__)


class Hub:
    """The front door's one reader of the run for its pages, and the pages' queues."""

    def __init__(self, app: web.Application) -> None:
        s = app[SETTINGS]
        self.app = app
        self.run = s.run
        self.pp, self.dp = s.spec.parallelism.pp, s.spec.parallelism.dp
        objective = s.spec.prefill.ttft_objective_ms
        self.view = DashboardView(s.run, time_scale=s.time_scale, window_s=WINDOW_S, ttft_objective_ms=objective)
        self.clients: set[asyncio.Queue[bytes | None]] = set()
        self._sent = 0  # the newest segment sent in an update
        self._holders: dict[str, str | None] = {}
        self._generation: int | None = None
        #: the run's dispatchers (one, or one per datacenter: `pipeline_plan.dispatch_dcs`) and who leads each
        self._dcs = dispatch_dcs(s.spec)
        self._dispatcher: dict[str | None, str] = {}
        self._redis_down: float | None = None

    # --- what the front door sees itself ---------------------------------------------------

    def on_result(self, r: PrefillResult) -> None:
        if r.ok:
            self.view.answer(time.time(), r.queue_ms + r.prefill_ms)

    def totals(self) -> dict[str, float]:
        """The request totals as /metrics prints them."""
        counter = self.app[METRICS].requests
        return {name: counter.labels(outcome)._value.get() for name, outcome in OUTCOMES.items()}

    # --- reading the run ---------------------------------------------------------------------

    async def read(self) -> None:
        """Follow the run until cancelled; Redis going away is a fault, marked when it answers again."""
        ids: dict[str, str] = {}
        next_look = 0.0
        while True:
            try:
                r = self.app[BUS].redis
                if not ids:
                    ids = await self._backlog(r)
                rows: Any = await r.xread(ids, count=1000, block=BLOCK_MS)  # type: ignore[arg-type]
                now = time.time()
                self._redis_back(now)
                for stream, entries in rows or ():
                    for entry_id, fields in entries:
                        ids[stream.decode()] = entry_id.decode()
                        self._add(fields, now)
                if time.monotonic() >= next_look:
                    await self._look(r, now)
                    next_look = time.monotonic() + LOOK_EVERY_S
            except TRANSIENT_ERRORS as exc:
                if self._redis_down is None:
                    self._redis_down = time.time()
                    log.info("dashboard: Redis not answering", error=repr(exc))
                await asyncio.sleep(0.5)
            except Exception as exc:  # the page is telemetry: it never stops the front door, nor itself
                log.warning("dashboard: reading the run failed; reading on in 1 s", error=repr(exc))
                await asyncio.sleep(1.0)

    async def _backlog(self, r: Redis) -> dict[str, str]:
        """The window's spans and events so far; the ids to read on from."""
        ids = {}
        now = time.time()
        for stream in (keys.spans_stream(self.run), keys.events_stream(self.run)):
            rows: Any = await r.xrevrange(stream, count=BACKLOG)
            for _, fields in reversed(rows):
                self._add(fields, now)
            ids[stream] = rows[0][0].decode() if rows else "0-0"
        return ids

    def _add(self, fields: dict[bytes, bytes], now: float) -> None:
        """One entry of the run's streams to the view. A malformed one is skipped: the page only
        watches; the stream's own consumers dead-letter it."""
        if (raw := fields.get(FIELD)) is None:
            return
        try:
            message = decode(raw)
        except WireError:
            return
        self.view.add(message, now)

    def _redis_back(self, now: float) -> None:
        if self._redis_down is not None:
            down = now - self._redis_down
            self.view.fault("redis-restart", self._redis_down, f"Redis did not answer for {down:.1f} s, then did again")
            self._redis_down = None
            self._holders.clear()  # a Redis that lost its keys shows every lease gone until renewed: not a loss

    async def _look(self, r: Redis, now: float) -> None:
        """Leases (a holder gone with no end marker: lost; a new one: a takeover; an end marker
        `left`: a drain), the generation (a move: a recovery) and the dispatcher's lease (a new
        leader: a dispatcher restart or takeover)."""
        slots = [(d, k) for k in range(self.pp) for d in range(self.dp)]
        n = len(slots)
        async with r.pipeline(transaction=False) as pipe:  # single-key commands: a cluster's pipeline refuses MGET
            for d, k in slots:
                pipe.get(keys.lease_key(self.run, d, k))
            for d, k in slots:
                pipe.hget(keys.lease_end_key(self.run, d, k), "state")
            pipe.get(keys.generation_key(self.run))
            for dc in self._dcs:
                pipe.get(keys.dispatcher_lease_key(self.run, dc))
            got: Any = await pipe.execute()
        held, ends, gen, leaders = got[:n], got[n : 2 * n], got[2 * n], got[2 * n + 1 :]
        for (d, k), h, end in zip(slots, held, ends, strict=True):
            self._slot(worker_id(k, d), slot_name(d, k), h.decode() if h else None, end, now)
        if gen is not None:
            g = int(gen)
            # every starting worker moves the generation on as it joins: a move is a recovery only
            # once the run has trained
            if self._generation is not None and g > self._generation and self.view.trained:
                self.view.fault("recovery", now, f"the run moved to recovery generation {g}")
            self._generation = g
        for dc, leader in zip(self._dcs, leaders, strict=True):
            holder, was = (leader.decode() if leader else None), self._dispatcher.get(dc)
            if holder and was and holder != was:
                what = "the run" if dc is None else f"datacenter {dc}"
                self.view.fault("dispatcher-restart", now, f"dispatcher {holder} leads {what} (was {was})")
            if holder:
                self._dispatcher[dc] = holder

    def _slot(self, w: str, slot: str, holder: str | None, end: bytes | None, now: float) -> None:
        first = w not in self._holders
        was = self._holders.get(w)
        self._holders[w] = holder
        if first or holder == was:
            return
        if was is None:  # a free slot taken (a mark only if its last holder was lost)
            assert holder is not None
            self.view.slot_taken(w, holder, now)
            return
        state = end.decode() if end else None
        if holder is None:
            if state == LeaseState.LEFT:
                self.view.fault("drain", now, f"worker {w} ({was}) left its slot {slot} (drained)", w)
            elif state not in (LeaseState.DONE, LeaseState.STOPPED):
                self.view.slot_lost(w, now, f"{was}'s lease on slot {slot} expired")
        else:  # another holder at once
            self.view.slot_lost(w, now, f"{was} gone from slot {slot}")
            self.view.slot_taken(w, holder, now)

    # --- fanning out -------------------------------------------------------------------------

    def event(self, name: str, view: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(view, separators=(',', ':'))}\n\n".encode()

    async def fan_out(self) -> None:
        """Every `UPDATE_EVERY_S`: the totals noted, and one update built (only with pages open)
        and queued to each page; a page `CLIENT_QUEUE` behind is dropped."""
        while True:
            await asyncio.sleep(UPDATE_EVERY_S)
            now = time.time()
            self.view.totals(now, self.totals())
            if not self.clients:
                self._sent = self.view.seq
                continue
            data = self.event("update", self.view.view(now, after=self._sent))
            self._sent = self.view.seq
            for q in list(self.clients):
                try:
                    q.put_nowait(data)
                except asyncio.QueueFull:
                    self.clients.discard(q)
                    with contextlib.suppress(asyncio.QueueEmpty):
                        q.get_nowait()
                    q.put_nowait(None)  # the page's handler ends; its browser reconnects

    def close(self) -> None:
        for q in self.clients:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)
        self.clients.clear()


DASHBOARD = web.AppKey("dashboard", Hub)


def setup(app: web.Application) -> None:
    """The page's routes, its reader (with the app) and the request totals it shows, at 0 from the start."""
    for outcome in OUTCOMES.values():
        app[METRICS].requests.labels(outcome)  # printed by /metrics at 0, so the page and it agree
    app.cleanup_ctx.append(_hub_ctx)
    app.on_shutdown.append(_close_pages)
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/events", events)


async def _hub_ctx(app: web.Application) -> AsyncIterator[None]:
    hub = Hub(app)
    app[DASHBOARD] = hub
    tasks = [
        asyncio.create_task(hub.read(), name="dashboard-read"),
        asyncio.create_task(hub.fan_out(), name="dashboard-fan-out"),
    ]
    yield
    hub.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close_pages(app: web.Application) -> None:
    """Open pages end at shutdown, so they do not hold the stop for its whole grace period."""
    if DASHBOARD in app:
        app[DASHBOARD].close()


def _authorized(request: web.Request) -> None:
    key = request.app[SETTINGS].api_key
    if not key:
        return
    given = request.query.get("key")
    header = f"Bearer {given}" if given is not None else request.headers.get("Authorization", "")
    if not bearer_ok(header, key):
        raise BadRequest(
            "missing or wrong API key: open /dashboard?key=<key> or send 'Authorization: Bearer <key>'",
            status=401,
            type_="authentication_error",
        )


async def page(request: web.Request) -> web.Response:
    """The live page (HTML, self-contained)."""
    _authorized(request)
    run = request.app[SETTINGS].run
    return web.Response(text=render(title=f"run {run}"), content_type="text/html")


async def events(request: web.Request) -> web.StreamResponse:
    """The page's server-sent events: a snapshot, then updates until the page goes (or is dropped)."""
    _authorized(request)
    hub = request.app[DASHBOARD]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    q: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=CLIENT_QUEUE)
    snapshot = hub.view.view(time.time())
    hub.clients.add(q)
    try:
        data: bytes | None = hub.event("snapshot", snapshot)
        while data is not None:
            async with asyncio.timeout(WRITE_S):
                await resp.write(data)
            data = await q.get()
    except ConnectionResetError:
        pass  # the page went
    except TimeoutError:
        log.info("dashboard: a page stopped reading; dropped", peer=request.remote)
    finally:
        hub.clients.discard(q)
    return resp
