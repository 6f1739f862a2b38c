"""wan_broker: owns every directed DC link of the spec and carries transfers over them.

`serve(settings, stop)` consumes the run's transfer stream; each `Transfer` goes to the driver
of its link and is acked only once its payload has been delivered. Per-link utilisation and
delivery accuracy go to the run's events stream every second.
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec

from services.wan_broker.links import LinkDriver
from services.wan_broker.metrics import BrokerMetrics
from shared import keys
from shared.bus import Bus, Delivery, Reject
from shared.bus.connection import TRANSIENT_ERRORS, Outage
from shared.health import Heartbeat, instance_id
from shared.logs import get_logger
from shared.policies.wan import LinkModel
from shared.settings import Settings
from shared.telemetry import MetricsServer
from shared.wire import LinkReport, Transfer

SERVICE = "wan_broker"
REPORT_INTERVAL_S = 1.0
#: Transfers in flight at once (each is one waiting handler): far above any pipeline's needs.
MAX_IN_FLIGHT = 10_000

log = get_logger(__name__)


def directed_links(settings: Settings) -> list[tuple[str, str]]:
    names = [dc.name for dc in settings.spec.datacenters]
    return [(a, b) for a, b in itertools.permutations(names, 2)]


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    spec = settings.spec
    async with Bus(settings.require_redis_url(), spec.bus, name=SERVICE) as bus:
        metrics = BrokerMetrics(settings.run)
        drivers = {
            (a, b): LinkDriver(bus, a, b, LinkModel.from_params(spec.link(a, b)), spec.wan.sharing, metrics)
            for a, b in directed_links(settings)
        }
        server = MetricsServer(
            metrics.registry,
            settings.metrics_host,
            settings.metrics_port,
            refresh=lambda: metrics.refresh(bus.redis, drivers),
            api_key=settings.metrics_key,
        )
        url = await server.start()

        async def on_transfer(d: Delivery) -> None:
            msg = d.message
            assert isinstance(msg, Transfer)  # the handler table routes only this kind here
            driver = drivers.get((msg.src_dc, msg.dst_dc))
            if driver is None:
                raise Reject(f"no WAN link {msg.src_dc} -> {msg.dst_dc} in the spec")
            await driver.carry(msg)

        cfg = msgspec.structs.replace(spec.bus, concurrency=MAX_IN_FLIGHT)
        info = {"run": settings.run, "links": len(drivers), "metrics_url": url}
        hb = Heartbeat(bus.redis, SERVICE, instance_id(), lambda: info)
        await hb.start()
        consumer = bus.consumer(
            keys.wan_stream(settings.run),
            SERVICE,
            {Transfer: on_transfer},
            name=f"{SERVICE}-{instance_id()}",
            config=cfg,
        )
        metrics.streams.add(consumer)
        log.info("broker ready", run=settings.run, links=len(drivers), sharing=spec.wan.sharing)
        outage = Outage("link reports")
        async with consumer:
            while not stop.is_set() and not consumer.crashed.is_set():
                try:
                    async with asyncio.timeout(REPORT_INTERVAL_S):
                        await stop.wait()
                except TimeoutError:
                    try:  # telemetry: a report Redis cannot take is skipped, the loop goes on
                        await _report(bus, settings.run, drivers)
                    except TRANSIENT_ERRORS as exc:
                        outage.failed(exc)
                    else:
                        outage.ok()
        await hb.stop()
        await server.stop()
        for driver in drivers.values():
            await driver.close()
        if consumer.error is not None:
            raise consumer.error


async def _report(bus: Bus, run: str, drivers: dict[tuple[str, str], LinkDriver]) -> None:
    for (a, b), driver in drivers.items():
        st = driver.stats()
        if st["transfers"] or st["in_flight"]:
            await bus.publish(
                keys.events_stream(run),
                LinkReport(
                    run=run,
                    src_dc=a,
                    dst_dc=b,
                    utilization=st["utilization"],
                    bytes_sent=st["bytes_sent"],
                    transfers=int(st["transfers"]),
                    in_flight=int(st["in_flight"]),
                    late_p99_ms=st["late_p99_ms"],
                ),
                maxlen=keys.EVENTS_MAXLEN,
                ride_out_s=0,  # telemetry: skipped rather than waited for (the next one follows in 1 s)
            )
