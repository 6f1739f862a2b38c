"""wan_broker: the Atlas slot arbiter of every directed DC link of the spec.

`serve(settings, stop)` consumes the run's WAN stream. The tensors themselves never pass through
here (they move on the workers' data plane); what the broker does depends on `wan.mode`:

* `model`: each `Transfer` (a cross-DC send already under way on the data plane) goes through its
  link's model (`LinkDriver`), and the receiver is released (a small `TensorReady` appended to its
  inbox) when the model says the last byte arrived; acked then;
* `kernel` / `none`: each `SlotRequest` is granted by the link's `SlotArbiter` (`SlotDriver`); the
  worker transmits on grant and reports `SlotDone`; the request is acked then.

Per-link utilisation goes to the run's events stream every second.

Tested by: tests/integration/test_wan_broker.py, tests/integration/test_service_metrics.py,
tests/integration/test_redis_restart.py.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec

from services.wan_broker.grants import SlotDriver
from services.wan_broker.links import LinkDriver
from services.wan_broker.metrics import BrokerMetrics
from shared.bus import HOLD, Bus, Delivery, Outcome, Reject
from shared.bus.connection import TRANSIENT_ERRORS, Outage
from shared.config.settings import Settings
from shared.control.health import Heartbeat, instance_id
from shared.policies.wan import LinkModel
from shared.runtime.logs import get_logger
from shared.service.telemetry import MetricsServer
from shared.wire import LinkReport, SlotDone, SlotRequest, Transfer, keys

SERVICE = "wan_broker"
REPORT_INTERVAL_S = 1.0
#: The WAN modes in which the broker grants slots (the workers move the bytes on real links).
GRANTING = ("kernel", "none")
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
        mode = spec.wan.mode
        consumer_ref: list[object] = []

        def release(entry: str) -> None:
            consumer_ref[0].release(entry)  # type: ignore[attr-defined]

        # the same link models as the analytic model's (shared.policies.pipeline_plan.model_inputs):
        # one clock in mode model
        models = {(a, b): LinkModel.from_params(spec.link(a, b), mode) for a, b in directed_links(settings)}
        drivers: dict[tuple[str, str], LinkDriver | SlotDriver] = {
            (a, b): (
                LinkDriver(bus, a, b, model, spec.wan.sharing, metrics)
                if mode == "model"
                else SlotDriver(bus, a, b, model, spec.wan.sharing, release, metrics)
            )
            for (a, b), model in models.items()
        }
        server = MetricsServer(
            metrics.registry,
            settings.metrics_host,
            settings.metrics_port,
            refresh=lambda: metrics.refresh(bus.redis, drivers),
            api_key=settings.metrics_key,
        )
        url = await server.start()

        def driver_of(src: str, dst: str, modes: tuple[str, ...], kind: str) -> Any:
            driver = drivers.get((src, dst))
            if driver is None:
                raise Reject(f"no WAN link {src} -> {dst} in the spec")
            if mode not in modes:
                raise Reject(f"wan.mode is {mode!r}: a {kind} belongs to wan.mode {' or '.join(modes)}")
            return driver

        async def on_transfer(d: Delivery) -> None:
            msg = d.message
            assert isinstance(msg, Transfer)  # the handler table routes only this kind here
            await driver_of(msg.src_dc, msg.dst_dc, ("model",), "Transfer").carry(msg)

        async def on_request(d: Delivery) -> Outcome:
            msg = d.message
            assert isinstance(msg, SlotRequest)
            await driver_of(msg.src_dc, msg.dst_dc, GRANTING, "SlotRequest").on_request(msg, d.id)
            return HOLD  # acked when the transfer is done

        async def on_done(d: Delivery) -> None:
            msg = d.message
            assert isinstance(msg, SlotDone)
            await driver_of(msg.src_dc, msg.dst_dc, GRANTING, "SlotDone").on_done(msg)

        cfg = msgspec.structs.replace(spec.bus, concurrency=MAX_IN_FLIGHT)
        info = {"run": settings.run, "links": len(drivers), "metrics_url": url}
        hb = Heartbeat(bus.redis, SERVICE, instance_id(), lambda: info)
        await hb.start()
        consumer = bus.consumer(
            keys.wan_stream(settings.run),
            SERVICE,
            {Transfer: on_transfer, SlotRequest: on_request, SlotDone: on_done},
            name=f"{SERVICE}-{instance_id()}",
            config=cfg,
        )
        consumer_ref.append(consumer)
        metrics.streams.add(consumer)
        log.info("broker ready", run=settings.run, links=len(drivers), sharing=spec.wan.sharing, wan=mode)
        outage = Outage("link reports")
        async with consumer:
            while not stop.is_set() and not consumer.crashed.is_set():
                try:
                    async with asyncio.timeout(REPORT_INTERVAL_S):
                        await stop.wait()
                except TimeoutError:
                    try:  # telemetry: a report Redis cannot take is skipped, the loop goes on
                        for driver in drivers.values():
                            await driver.expire()
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


async def _report(bus: Bus, run: str, drivers: dict[tuple[str, str], LinkDriver | SlotDriver]) -> None:
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
                    busy_s=st["busy_s"],
                ),
                maxlen=keys.EVENTS_MAXLEN,
                ride_out_s=0,  # telemetry: skipped rather than waited for (the next one follows in 1 s)
            )
