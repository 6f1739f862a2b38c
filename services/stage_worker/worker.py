"""stage_worker: lease a slot, build its stage, wait for every peer, train, finish cleanly.

If a peer's lease expires (its process died) and the run checkpoints (`training.checkpoint_every`),
the run pauses: this worker drops the cut-short iteration, joins a new recovery generation, waits
for a replacement to take the slot, restores the newest checkpoint every slot has and trains on
from there (`membership/take_part.py` drives it through `membership/generations.py`'s protocol). Without checkpoints, or
when no replacement comes within `training.recovery_timeout_s`, it publishes `WorkerFailed` naming
the slot and stops with an error instead of waiting forever for tensors that will never come.

Tested by: tests/e2e/test_training_correctness.py, tests/e2e/test_worker_failure.py,
tests/e2e/test_worker_recovery.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable

import msgspec
import torch

from services.stage_worker import chaos
from services.stage_worker.fill.announcer import GuestMemory
from services.stage_worker.fill.executor import Filler
from services.stage_worker.membership.generations import Generations
from services.stage_worker.membership.lease import RunStopped, Slot, SlotError, SlotLease
from services.stage_worker.membership.leaving import ASK_S, told_to_leave
from services.stage_worker.membership.take_part import take_part
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.stage_port import StagePort, build_port
from services.stage_worker.port.transport import plane_addresses
from services.stage_worker.train.runner import StageRunner
from services.stage_worker.train.timing import Profile, profile_and_prior
from services.stage_worker.train.trainer import StageTrainer
from services.stage_worker.train.warm import Warm, guest_model, model_bytes, warm_up
from shared.bus import Bus, Consumer
from shared.bus.connection import TRANSIENT_ERRORS
from shared.config.model_info import CheckpointError
from shared.config.settings import Settings
from shared.control.health import Heartbeat, instance_id
from shared.control.leases import holder_client_name
from shared.dataplane import DataPlane
from shared.dataplane.kv import KvServer, KvShelf
from shared.model.corpus import DataError
from shared.model.devices import DeviceError, check_kind, describe, select_device, slot_index
from shared.model.prefill import PrefillModel
from shared.model.training import load_corpus
from shared.model.trainstate import check_resume, stage_state
from shared.policies.bubbles import BubblePredictor
from shared.policies.fill import FillQueue, piece_tokens
from shared.policies.pipeline_plan import dispatch_dc, placement_of
from shared.policies.placement import Placement
from shared.policies.prefill_cost import PrefillProfile
from shared.policies.restarts import EXIT_CONFIG
from shared.runtime import priority
from shared.runtime.logs import get_logger
from shared.service.main import stopped_by
from shared.service.telemetry import MetricsServer
from shared.wire import PrefillBatch, SlotGrant, TensorReady, WorkerFailed, keys

SERVICE = "stage_worker"
SWITCH_INTERVAL_S = 0.0001
#: Prefill batches a worker holds at once (its credit: a few, each at most half its window); more wait in the stream.
FILL_CONCURRENCY = 64

log = get_logger(__name__)


def check_device(settings: Settings) -> str:
    """What the spec's device resolves to here. Before anything waits or is leased (the service
    runs it before it waits for Redis): `device.kind: cuda` on a machine without CUDA stops here."""
    try:
        return check_kind(settings.spec.device.kind)
    except DeviceError as exc:
        log.error("cannot start: the configured device is not available", error=str(exc))
        raise SystemExit(EXIT_CONFIG) from None


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    kind = check_device(settings)
    priority.configure(settings.compute_priority)
    if kind == "cpu":
        torch.set_num_threads(1)  # several workers share the machine's cores
    # Two threads hand the GIL to each other at the moments that matter: the prefill thread holds
    # it between torch ops when training input arrives (the loop must notice it and make prefill
    # yield), and the loop holds it when the prefill thread wakes to take over a batch. The default
    # 5 ms switch interval would delay either by that much. 0.1 ms rather than 0.5 was measured
    # while the prefill thread also ran a batch's first block (it runs on the loop now): the
    # bubble's prefill started 0.2 ms sooner (dispatch p50 0.55-0.58 against 0.75-0.81 ms,
    # bench/bubble_fill.py --time-scale 6, two runs each, interleaved), slowdown and fill unchanged.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    spec, run = settings.spec, settings.run
    placement = placement_of(spec)  # an infeasible spec fails here, naming the missing GPUs
    holder = instance_id()  # its connections carry its name: a spare sees when none is left (lease_liveness)
    async with Bus(settings.require_redis_url(), spec.bus, name=holder_client_name(holder)) as bus:
        lease = SlotLease(
            bus.redis,
            run,
            spec.parallelism.pp,
            spec.parallelism.dp,
            holder=holder,
            recoverable=spec.training.recovers,
            liveness=settings.lease_liveness,
        )
        allowed = None if settings.dc is None else lambda s: placement.stage_dc[s.stage] == settings.dc
        # A replacement may start before its dead predecessor's lease expired: it waits that long.
        warm: asyncio.Future[Warm] | None = None
        try:
            slot = await lease.acquire(
                wait_s=keys.LEASE_TTL_MS / 1000 + 1 if spec.training.recovers else 0.0, allowed=allowed
            )
        except SlotError:
            if not spec.training.recovers:  # nothing could resume with a spare: an extra worker is a mistake
                raise
            warm = asyncio.ensure_future(asyncio.to_thread(warm_up, spec))  # ready before it is needed
            spare = await lease.wait_as_spare(stop, allowed)
            if spare is None:
                log.info("left as a spare: stopped, or the run finished")
                await asyncio.gather(warm, return_exceptions=True)
                return
            slot = spare
        device = select_device(spec.device.kind, slot_index(slot.replica, slot.stage, spec.parallelism.pp))
        log.info("device chosen", slot=slot.name, kind=spec.device.kind, **describe(device))
        metrics = WorkerMetrics(run, slot.name, spec.prefill.model_name)
        server = MetricsServer(
            metrics.registry,
            settings.metrics_host,
            settings.metrics_port,
            refresh=lambda: metrics.refresh(bus.redis),
            api_key=settings.metrics_key,
        )
        url = await server.start()  # a port in use fails here (the slot's lease expires by itself)
        info = {"run": run, "slot": slot.name, "metrics_url": url}
        #: Figures read at each beat, added once their source exists (the KV server: `kv_*`).
        readings: dict[str, Callable[[], object]] = {}
        hb = Heartbeat(
            bus.redis, SERVICE, f"{run}-{slot.name}", lambda: {**info, **{k: read() for k, read in readings.items()}}
        )
        await hb.start()
        watch = asyncio.create_task(lease.watch(), name="lease")  # renews from now on
        try:
            await _train(bus, settings, placement, lease, watch, slot, stop, metrics, device, readings, warm)
        except RunStopped as exc:
            log.info("run stopped by a peer's deliberate stop", slot=slot.name, reason=str(exc))
            await lease.mark_stopped(f"slot {slot.name} stopped with its peers")
        except SlotError as exc:
            await lease.abort(str(exc))
            await bus.publish(
                keys.events_stream(run),
                WorkerFailed(run=run, slot=slot.name, reason=str(exc)),
                maxlen=keys.EVENTS_MAXLEN,
            )
            raise
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await hb.stop()
            await server.stop()
            await lease.release()


async def _train(
    bus: Bus,
    settings: Settings,
    placement: Placement,
    lease: SlotLease,
    watch: asyncio.Task[None],
    slot: Slot,
    stop: asyncio.Event,
    metrics: WorkerMetrics,
    device: torch.device,
    readings: dict[str, Callable[[], object]],
    warm: asyncio.Future[Warm] | None = None,
) -> None:
    """Build this slot's stage (its models, runner and port, and with BubbleTea its fill
    executor), take part in the run until it ends or this worker leaves, then close the stage in
    the reverse order."""
    ready, trainer = await _trainer(settings, slot, device, warm)
    profile, prior = await asyncio.to_thread(profile_and_prior, settings.spec, slot, trainer)
    prefill = await _guest(settings, slot, device, ready)
    gens = Generations(bus.redis, settings.run, lease.all_slots, url=bus.url, name=bus.name)  # named as its bus
    runner = await _runner(bus, settings, placement, lease, slot, trainer, profile, prior, prefill, metrics, device)
    plane = DataPlane(settings.require_redis_url(), settings.run, plane_addresses(settings, slot, placement))
    tied = runner.trainer.tied is not None
    port = runner.port = build_port(
        bus.redis,
        settings,
        placement,
        slot,
        lease.all_slots,
        plane,
        runner.outbox,
        runner.mailbox,
        lambda: gens.current,
        tied=tied,
    )
    inbox = bus.consumer(
        keys.inbox(settings.run, slot.replica, slot.stage),
        "worker",
        {TensorReady: port.on_ready, SlotGrant: port.on_grant},
        name=slot.name,
        fence=lease.fence,  # a worker whose slot may be another's renews first (lost: it stops)
    )
    metrics.streams.add(inbox)
    fill: Consumer | None = None
    kv_server: KvServer | None = None
    if prefill is not None:
        kv_server = await _serve_prefill(settings, port, plane, readings)
        fill = await _start_fill(bus, settings, lease, slot, runner, port, prefill, metrics, device)
    stop_run, leave = asyncio.Event(), asyncio.Event()
    routing = asyncio.create_task(_route_stop(stop, stop_run, leave, runner, lease.holder), name="stop-route")
    try:
        await take_part(runner, inbox, lease, watch, gens, stop_run, leave)
    finally:
        routing.cancel()
        await _close(runner, port, fill, kv_server)


async def _trainer(
    settings: Settings, slot: Slot, device: torch.device, warm: asyncio.Future[Warm] | None
) -> tuple[Warm | None, StageTrainer]:
    """What a spare loaded while it waited (`warm`; None: not a spare), and the stage's trainer over
    that corpus or one loaded now. What the launcher's `check_training` refuses stops the worker
    here too, saying so (`EXIT_CONFIG`)."""
    spec = settings.spec
    try:
        ready = await warm if warm is not None else None
        corpus = ready.corpus if ready is not None else await asyncio.to_thread(load_corpus, spec)
        return ready, await asyncio.to_thread(StageTrainer, spec, slot.replica, slot.stage, corpus, device)
    except (CheckpointError, DataError) as exc:
        log.error("cannot train the spec's model or data", slot=slot.name, error=str(exc))
        raise SystemExit(EXIT_CONFIG) from None


async def _guest(settings: Settings, slot: Slot, device: torch.device, ready: Warm | None) -> PrefillModel | None:
    """With BubbleTea, the guest's prefill model (a spare's, `ready`, when it built it while it
    waited); failing on purpose where `BUBBLETEA_CHAOS_PREFILL` asks."""
    spec = settings.spec
    if not spec.bubbletea.enabled:
        return None
    prefill = await asyncio.to_thread(guest_model, spec, device, ready.prefill if ready is not None else None)
    if settings.chaos_prefill:
        prefill = chaos.failing(prefill, settings.chaos_prefill)
        log.warning(
            "fault injection: this worker's prefill fails on purpose",
            slot=slot.name,
            **{chaos.ENV: settings.chaos_prefill},
        )
    return prefill


async def _runner(
    bus: Bus,
    settings: Settings,
    placement: Placement,
    lease: SlotLease,
    slot: Slot,
    trainer: StageTrainer,
    profile: Profile,
    prior: dict[int, float],
    prefill: PrefillModel | None,
    metrics: WorkerMetrics,
    device: torch.device,
) -> StageRunner:
    """The stage's runner: its timing and bubble prior, the device memory a guest may use, and where
    it starts (a save to resume from, `bubbletea train --resume`)."""
    spec, run = settings.spec, settings.run
    memory = int(spec.device.memory_gib * (1 << 30))
    if prefill is not None:
        memory -= model_bytes(prefill)  # the guest's weights live beside the owner's
    runner = StageRunner(
        bus,
        spec,
        run,
        slot,
        placement,
        trainer,
        Mailbox(),
        BubblePredictor(prior),
        profile,
        free_memory_bytes=max(0, memory - trainer.state_bytes()),
        metrics=metrics,
        saving=bool(await bus.redis.exists(keys.save_request_key(run))),
    )
    if prefill is not None and device.type == "cuda":  # measured once training's first step has peaked; none before
        index = slot_index(slot.replica, slot.stage, spec.parallelism.pp)
        runner.bubbles.memory = GuestMemory.on_gpu(device, index, len(lease.all_slots), runner.free_memory_bytes)
        runner.bubbles.free_memory_bytes = 0
    if settings.resume is not None:  # `bubbletea train --resume`: this stage's state after the saved iteration
        saved_it = check_resume(settings.resume, spec)
        runner.resume_from = (saved_it, stage_state(settings.resume, slot.stage, spec.parallelism.pp))
        log.info("resuming from a save", slot=slot.name, directory=str(settings.resume), after_iteration=saved_it)
    return runner


async def _serve_prefill(
    settings: Settings, port: StagePort, plane: DataPlane, readings: dict[str, Callable[[], object]]
) -> KvServer | None:
    """Serve what prefill leaves on this worker: the preempted prefills' snapshots, for whoever
    resumes them, and with `prefill.kv_store: plane` the KV caches computed here (returns their
    server: decoders fetch them over TCP from its data-plane host, on a port of its own)."""
    spec = settings.spec
    kv_server = None
    if spec.prefill.kv_store == "plane" and spec.prefill.kv_ttl_s > 0:
        shelf = KvShelf(spec.prefill.kv_ttl_s, spec.prefill.kv_budget_mb << 20)
        kv_server = server = KvServer(shelf, plane.addresses[0])
        readings["kv_holder"] = lambda: server.holder  # "host:port" is the holder in every KV handle
        readings["kv_held"] = lambda: server.held  # caches held now: 0 once every decode freed its own
        readings["kv_served"] = lambda: server.served  # fetches answered with a cache
        await server.start()
    # resumed items computed again because their snapshot is in another DC
    readings["snapshots_elsewhere"] = lambda: port.prefill.elsewhere
    port.prefill.kv_server = kv_server
    await port.prefill.start()  # preempted prefills' snapshots stay here, served to whoever resumes them
    return kv_server


async def _start_fill(
    bus: Bus,
    settings: Settings,
    lease: SlotLease,
    slot: Slot,
    runner: StageRunner,
    port: StagePort,
    prefill: PrefillModel,
    metrics: WorkerMetrics,
    device: torch.device,
) -> Consumer:
    """The fill executor (`runner.filler`), and the consumer of this slot's fill stream, started."""
    spec, run = settings.spec, settings.run
    on_gpu = device.type == "cuda"
    runner.filler = Filler(
        bus,
        run,
        slot.name,
        prefill,
        spec.prefill.model_name,
        port,
        runner.prefill_span,
        FillQueue.from_spec(spec.bubbletea),
        PrefillProfile.of_spec(spec, on_gpu=on_gpu),
        metrics,
        piece_tokens(spec.bubbletea.piece_tokens, on_gpu=on_gpu),
        dispatch_dc(spec, slot.stage),
    )
    fill = bus.consumer(
        keys.fill_stream(run, slot.replica, slot.stage, dispatch_dc(spec, slot.stage)),
        keys.FILL_GROUP,
        {PrefillBatch: runner.filler.on_batch},
        name=slot.name,
        config=msgspec.structs.replace(spec.bus, concurrency=FILL_CONCURRENCY),
        fence=lease.fence,
    )
    metrics.streams.add(fill)
    await fill.start()
    return fill


async def _close(runner: StageRunner, port: StagePort, fill: Consumer | None, kv_server: KvServer | None) -> None:
    """Close the stage, the reverse of its set-up."""
    runner.close()
    await port.close()
    if runner.filler is not None:
        # Hand back what is queued, answer and report what ran; from now on a batch the fill
        # consumer still delivers goes straight back, rather than waiting unrun until the
        # dispatcher's lost-batch timeout.
        await runner.filler.close()
    if fill is not None:
        # A batch still unreported stays pending; the dispatcher requeues it when no report comes.
        await fill.stop(grace_s=1.0)
    if kv_server is not None:  # last: the caches die with the worker (a later fetch fails, saying so)
        await kv_server.close()
    await port.close_prefill()  # its snapshots too


async def _route_stop(
    stop: asyncio.Event, stop_run: asyncio.Event, leave: asyncio.Event, runner: StageRunner, holder: str
) -> None:
    """What a signal asks of this worker. SIGTERM alone (an orchestrator evicting or draining it)
    asks it to leave while the run goes on (`leaving.py`); any other stop, a SIGTERM once its
    launcher marked the run stopping, and the SIGTERM of its parent's death (`die_with_parent`: a
    launcher killed with SIGKILL, its Redis likely gone with it) stop the whole run, as before
    drains. Redis is asked for `ASK_S` at most: unanswered, it is a stop (a worker once waited for
    ever on a Redis that had died with its launcher)."""
    parent = os.getppid()
    await stop.wait()
    drain = stopped_by(stop) is signal.SIGTERM and os.getppid() == parent
    try:
        async with asyncio.timeout(ASK_S):
            drain = drain and not await runner.bus.redis.exists(keys.run_stop_key(runner.run))
            if drain:
                await told_to_leave(runner, holder)
    except TRANSIENT_ERRORS:  # no Redis to ask (TimeoutError is an OSError): a stop, as before
        drain = False
    (leave if drain else stop_run).set()
