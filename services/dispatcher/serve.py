"""The dispatcher as a process: its lease, and its terms as the run's leader (consumers and their
handler tables, the timer); metrics and heartbeat for its whole life.

A process starts as a standby: it reads nothing and publishes no readiness while another
dispatcher leads the run (`services.dispatcher.lease`, logged once per leader). When it takes the
lease it leads a **term** (`lead`), as a freshly started dispatcher does: a new `Dispatcher`, whose
consumers first claim every entry the run's earlier dispatchers left pending (their requests, held
until answered; what they read and had not acked), at once rather than after `bus.claim_idle_ms`:
the lease says those are fenced; and which adopts the batches they sent that the workers hold
(services/dispatcher/takeover.py). While it leads it takes over, every second, what a deposed
dispatcher let go on after a stall read before its fence stopped it (`takeover.sweep`).
A term ends when the process stops or the lease is lost; a
deposed leader stops its consumers at once, withdraws its readiness and waits as a standby again
(it does not exit: `bubbletea up` would count each loss as a death towards its crash-loop limit,
and a standby beside the leader is what takes over). A stopping leader hands the lease over. A
process that leads again (its lease lapsed in a Redis outage, a master's failover: no other took it)
keeps what it measured of the bubbles' rate (`DispatchState.carry_admission`): a fresh measurement
would refuse every request with an objective until every worker came round again. A process that
takes the lease from another starts from the rate its predecessor published (`takeover.measurement`).

Tested by: tests/integration/test_dispatcher_leadership.py, tests/integration/test_service_metrics.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import time
from dataclasses import dataclass

from services.dispatcher.dispatcher import SERVICE, Dispatcher
from services.dispatcher.lease import DispatcherLease
from services.dispatcher.metrics import DispatcherMetrics
from services.dispatcher.takeover import (
    SWEEP_EVERY_S,
    adopted,
    claim,
    held_batches,
    measurement,
    publish_measurement,
    publish_snapshot,
    sweep,
)
from shared.bus import Bus
from shared.bus.connection import TRANSIENT_ERRORS, Outage, sleep_unless
from shared.bus.consumer import AfterRead, Consumer
from shared.bus.delivery import Handlers
from shared.config.settings import Settings
from shared.config.spec import ConfigError
from shared.control import serving, verdicts
from shared.control.health import Heartbeat, instance_id
from shared.policies.dc_routing import publish_every_s
from shared.policies.dispatch import DispatchState
from shared.policies.pipeline_plan import dispatch_dcs, stages_of
from shared.runtime.logs import get_logger
from shared.service.telemetry import MetricsServer
from shared.wire import BubbleEnd, BubbleStart, PrefillOff, PrefillReport, PrefillRequest, WorkerJoined, keys

#: A progress line in the log this often.
LOG_EVERY_S = 10.0
#: How long a stopping dispatcher tries its last writes (the last bubbles' records, its readiness
#: withdrawn, its heartbeat deleted): a publish otherwise rides a Redis outage out for 30 s, and a
#: launcher killed with SIGKILL takes its embedded Redis with it (a CI run saw the dispatcher
#: outlive it by more than 30 s). What is not written then expires by itself.
LAST_WRITES_S = 3.0

log = get_logger(__name__)


def served_dc(settings: Settings) -> str | None:
    """The datacenter this dispatcher serves: None, the whole run (`bubbletea.dispatch: one`), or
    with `per_dc` the one BUBBLETEA_DC names; a `ConfigError` if it names none that holds stages."""
    dcs = dispatch_dcs(settings.spec)
    if dcs == [None]:
        return None
    if settings.dc not in dcs:
        named = "is not set" if settings.dc is None else f"is {settings.dc!r}"
        raise ConfigError(
            f"bubbletea.dispatch is per_dc: a dispatcher serves one datacenter, and BUBBLETEA_DC {named} "
            f"(one of {', '.join(str(d) for d in dcs)}: the datacenters that hold stages)"
        )
    return settings.dc


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    spec, run = settings.spec, settings.run
    dc = served_dc(settings)
    async with Bus(settings.require_redis_url(), spec.bus, name=SERVICE, stop=stop) as bus:
        lease = DispatcherLease(bus.redis, run, f"{SERVICE}-{instance_id()}", dc=dc)
        metrics = DispatcherMetrics(run, spec.prefill.model_name)
        term: list[Dispatcher] = []  # the term under way, if any
        last: DispatchState[PrefillRequest] | None = None  # the state of this process's last term
        server = MetricsServer(
            metrics.registry,
            settings.metrics_host,
            settings.metrics_port,
            refresh=lambda: metrics.refresh(bus.redis, term[0].state if term else None),
            api_key=settings.metrics_key,
        )
        url = await server.start()

        def info() -> dict[str, object]:
            now = term[0].info() if term else {"run": run, "dc": dc or ""}
            return {**now, "role": lease.role.value, "leader": lease.leader or "", "metrics_url": url}

        hb = Heartbeat(bus.redis, SERVICE, instance_id(), info)
        await hb.start()
        done = asyncio.Event()  # the last term is over: the lease may stop stepping
        stepping = asyncio.create_task(lease.watch(done), name="dispatcher-lease")
        try:
            while not stop.is_set():
                await _either(stop, lease.leading)  # standing by
                if stop.is_set():
                    break
                term[:] = [Dispatcher(bus, spec, run, settings.time_scale, lease=lease, metrics=metrics, dc=dc)]
                if last is not None:  # the bubbles' rate this process measured (a failover's lapse)
                    term[0].state.carry_admission(last)
                elif (measured := await measurement(bus.redis, run, dc)) is not None:  # its predecessor's
                    term[0].state.carry_admission(measured)
                    log.info("the last leader's measurement taken over", rate=measured.rate, at=measured.at)
                try:
                    await lead(term[0], stop)
                finally:
                    last = term[0].state
                    term.clear()
        finally:
            done.set()
            stepping.cancel()  # (a step under way with Redis gone would only retry)
            await asyncio.gather(stepping, return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LAST_WRITES_S):
                    await lease.release()
            await last_writes(None, hb)
            await server.stop()


async def lead(d: Dispatcher, stop: asyncio.Event) -> None:
    """One term as the run's (or `d.dc`'s) leader, until `stop` or the lease is lost (`d.lease.deposed`)."""
    bus, run, lease, dc = d.bus, d.run, d.lease, d.dc
    assert lease is not None
    # A term ends once it was deposed, even if the process leads again before it looks (it waits
    # out an outage in backoff): the next term starts afresh, its consumers new.
    began = lease.terms
    # Every stream is read in batches and handled in order; what a read decided is written in
    # one round trip (`Dispatcher.flush`), its entries' acks in it. Requests are held (acked once
    # answered or failed), so they take no handler slot however many wait.
    requests = bus.consumer(
        keys.prefill_requests_stream(run, dc),
        SERVICE,
        {PrefillRequest: d.on_request},
        name=d.instance,
        sequential=True,
        after_read=d.requests_read,
        # a request dead-lettered is answered, failed, and counted out of flight
        last_word=functools.partial(serving.fail_dead_request, bus.redis, run, dc=dc),
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
            keys.bubbles_stream(run, dc),
            {BubbleStart: d.on_start, WorkerJoined: d.on_joined, BubbleEnd: d.on_end, PrefillOff: d.on_off},
        ),
        (keys.prefill_reports_stream(run, dc), {PrefillReport: d.on_report}),
    )
    for stream, table in tables:
        readers[stream] = bus.consumer(
            stream, SERVICE, table, name=d.instance, sequential=True, after_read=flushing(stream)
        )
    consumers = [*readers.values(), requests]
    d.metrics.streams.add(*consumers)
    # What earlier dispatchers of the run left is ours now, at once (`takeover`): their pending
    # entries, which each consumer's first read takes, and their batches the workers hold.
    claimed = sum([await claim(c) for c in consumers])
    p, now = d.spec.parallelism, time.time()
    held = await held_batches(bus.redis, run, stages_of(d.spec, dc), p.dp, dc)
    for stream, batch in held:
        d.state.adopt(adopted(stream, batch, d.model_info), now)
    for c in consumers:
        await c.start()
    # What start-up made (imports, the app, the clients) lives as long as the process: out of
    # the collector's way, so its passes walk only what the hot path allocates.
    gc.freeze()
    log.info(
        "dispatcher ready",
        run=run,
        dc=dc or "",
        enabled=d.spec.bubbletea.enabled,
        order=d.spec.bubbletea.order,
        batches=d.state.batch_prefix,
        claimed=claimed,
        adopted=len(held),
    )
    next_log = time.monotonic() + LOG_EVERY_S
    chores = Chores(d, consumers)
    outage = Outage("dispatcher tick")
    try:
        while not stop.is_set() and lease.leads_term(began):
            crashed = next((c for c in consumers if c.crashed.is_set()), None)
            if crashed is not None:
                raise RuntimeError(f"consumer of {crashed.stream} crashed: {crashed.error!r}")
            try:  # a Redis outage is ridden out: back off, tick again (the state kept while the lease lasts)
                await d.tick()
                await chores.run()
            except TRANSIENT_ERRORS as exc:
                await sleep_unless(stop, outage.failed(exc))
                continue
            outage.ok()
            if time.monotonic() > next_log:
                next_log += LOG_EVERY_S
                log.info("dispatcher progress", **d.info())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(d.state.tick_s):
                    await _either(stop, lease.deposed)
    finally:
        deposed = not lease.leads_term(began)
        for c in reversed(consumers):
            # Held requests stay pending for the next dispatcher: no grace needed for them; a
            # deposed leader's handlers could write nothing (its writes are refused).
            await c.stop(grace_s=0 if deposed or c is requests else None)
        await last_writes(d, None)


@dataclass
class Every:
    """A chore's timer: due at once, then once `every_s` has passed since it last was."""

    every_s: float
    _next: float = 0.0

    def due(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self.every_s
        return True


class Chores:
    """A leader's work beside its streams and its tick, each on its own timer: the readiness verdict
    and the measurement a successor starts from; with a dispatcher per datacenter, the snapshot the
    front doors route on (`dc_routing.publish_every_s`); the sweep of what a deposed leader read
    (`takeover.sweep`); and the in-flight count checked against the request streams."""

    def __init__(self, d: Dispatcher, consumers: list[Consumer]) -> None:
        self.d, self.consumers = d, consumers
        self.readiness = Every(verdicts.READINESS_EVERY_S)
        self.board = Every(publish_every_s(d.state.time_scale, verdicts.READINESS_EVERY_S))
        self.sweep = Every(SWEEP_EVERY_S)
        self.reconcile = Every(serving.INFLIGHT_RECONCILE_S)

    async def run(self) -> None:
        """Those due now, in that order (a Redis error is the caller's: it rides the outage out)."""
        d, r = self.d, self.d.bus.redis
        if self.readiness.due(time.monotonic()):
            await d.check_readiness()
            await publish_measurement(r, d.run, d.state, d.dc)
        if d.dc is not None and self.board.due(time.monotonic()):
            await publish_snapshot(r, d.run, d.state, d.dc, d.verdict.ready)
        if self.sweep.due(time.monotonic()):
            await sweep(self.consumers)
        if self.reconcile.due(time.monotonic()):
            await serving.reconcile_inflight(r, d.run, SERVICE, d.dc)


async def _either(a: asyncio.Event, b: asyncio.Event) -> None:
    """Until `a` or `b` is set."""
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def last_writes(d: Dispatcher | None, hb: Heartbeat | None, within_s: float = LAST_WRITES_S) -> None:
    """A term's last writes: its last bubbles' records (after the consumers stopped) and its
    readiness verdict withdrawn; then, with `hb`, the process's heartbeat deleted. Each tried for
    `within_s` at most (`LAST_WRITES_S`)."""
    if d is not None:
        with contextlib.suppress(TimeoutError, *TRANSIENT_ERRORS):
            async with asyncio.timeout(within_s):
                await d.telemetry.flush()
                await verdicts.withdraw_readiness(d.bus.redis, d.run, d.instance)
    if hb is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await hb.stop()
