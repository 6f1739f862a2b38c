"""The dispatcher as a process: its consumers and their handler tables, the timer, metrics and heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import time

from services.dispatcher.dispatcher import SERVICE, Dispatcher
from shared.bus import Bus
from shared.bus.connection import TRANSIENT_ERRORS, Outage, sleep_unless
from shared.bus.consumer import AfterRead, Consumer
from shared.bus.delivery import Handlers
from shared.control import keys, serving
from shared.control.health import Heartbeat, instance_id
from shared.runtime.logs import get_logger
from shared.runtime.telemetry import MetricsServer
from shared.spec.settings import Settings
from shared.wire import BubbleEnd, BubbleStart, PrefillOff, PrefillReport, PrefillRequest, WorkerJoined

#: A progress line in the log this often.
LOG_EVERY_S = 10.0
#: How long a stopping dispatcher tries its last writes (the last bubbles' records, its readiness
#: withdrawn, its heartbeat deleted): a publish otherwise rides a Redis outage out for 30 s, and a
#: launcher killed with SIGKILL takes its embedded Redis with it (a CI run saw the dispatcher
#: outlive it by more than 30 s). What is not written then expires by itself.
LAST_WRITES_S = 3.0

log = get_logger(__name__)


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    spec, run = settings.spec, settings.run
    async with Bus(settings.require_redis_url(), spec.bus, name=SERVICE, stop=stop) as bus:
        d = Dispatcher(bus, spec, run, settings.time_scale)
        me = d.instance
        server = MetricsServer(
            d.metrics.registry,
            settings.metrics_host,
            settings.metrics_port,
            refresh=lambda: d.metrics.refresh(bus.redis, d.state),
            api_key=settings.metrics_key,
        )
        url = await server.start()
        hb = Heartbeat(bus.redis, SERVICE, instance_id(), lambda: {**d.info(), "metrics_url": url})
        # Every stream is read in batches and handled in order; what a read decided is written in
        # one round trip (`Dispatcher.flush`), its entries' acks in it. Requests are held (acked once
        # answered or failed), so they take no handler slot however many wait.
        requests = bus.consumer(
            keys.PREFILL_REQUESTS_STREAM,
            SERVICE,
            {PrefillRequest: d.on_request},
            name=me,
            sequential=True,
            after_read=d.requests_read,
            # a request dead-lettered is answered, failed, and counted out of flight
            last_word=functools.partial(serving.fail_dead_request, bus.redis),
        )
        d.acks = requests
        readers: dict[str, Consumer] = {}

        def flushing(stream: str) -> AfterRead:
            async def after_read(done: list[str]) -> bool:
                return await d.flush(readers[stream], done)

            return after_read

        tables: tuple[tuple[str, Handlers], ...] = (
            # a bubble's end never overtakes its start
            (
                keys.bubbles_stream(run),
                {BubbleStart: d.on_start, WorkerJoined: d.on_joined, BubbleEnd: d.on_end, PrefillOff: d.on_off},
            ),
            (keys.prefill_reports_stream(run), {PrefillReport: d.on_report}),
        )
        for stream, table in tables:
            readers[stream] = bus.consumer(
                stream, SERVICE, table, name=me, sequential=True, after_read=flushing(stream)
            )
        consumers = [*readers.values(), requests]
        d.metrics.streams.add(*consumers)
        await hb.start()
        for c in consumers:
            await c.start()
        # What start-up made (imports, the app, the clients) lives as long as the process: out of
        # the collector's way, so its passes walk only what the hot path allocates.
        gc.freeze()
        log.info("dispatcher ready", run=run, enabled=spec.bubbletea.enabled, order=spec.bubbletea.order)
        next_log = time.monotonic() + LOG_EVERY_S
        next_check = next_reconcile = time.monotonic()
        outage = Outage("dispatcher tick")
        try:
            while not stop.is_set():
                crashed = next((c for c in consumers if c.crashed.is_set()), None)
                if crashed is not None:
                    raise RuntimeError(f"consumer of {crashed.stream} crashed: {crashed.error!r}")
                try:  # a Redis outage is ridden out: back off, then tick again (the state is kept)
                    await d.tick()
                    if time.monotonic() >= next_check:
                        next_check = time.monotonic() + serving.READINESS_EVERY_S
                        await d.check_readiness()
                    if time.monotonic() >= next_reconcile:
                        next_reconcile = time.monotonic() + serving.INFLIGHT_RECONCILE_S
                        await serving.reconcile_inflight(bus.redis, SERVICE)
                except TRANSIENT_ERRORS as exc:
                    await sleep_unless(stop, outage.failed(exc))
                    continue
                outage.ok()
                if time.monotonic() > next_log:
                    next_log += LOG_EVERY_S
                    log.info("dispatcher progress", **d.info())
                try:
                    async with asyncio.timeout(d.state.tick_s):
                        await stop.wait()
                except TimeoutError:
                    pass
        finally:
            for c in reversed(consumers):
                # Held requests stay pending for the next dispatcher: no grace needed for them.
                await c.stop(grace_s=0 if c is requests else None)
            await last_writes(d, hb)
            await server.stop()


async def last_writes(d: Dispatcher, hb: Heartbeat, within_s: float = LAST_WRITES_S) -> None:
    """The last bubbles' records (after the consumers stopped), the readiness verdict withdrawn and
    the heartbeat deleted: tried for `within_s` at most (`LAST_WRITES_S`)."""
    with contextlib.suppress(TimeoutError, *TRANSIENT_ERRORS):
        async with asyncio.timeout(within_s):
            await d.telemetry.flush()
            await serving.withdraw_readiness(d.bus.redis, d.instance)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within_s):
            await hb.stop()
