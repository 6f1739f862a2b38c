"""stage_worker: lease a slot, build its stage, wait for every peer, train, finish cleanly.

If a peer's lease expires (its process died) and the run checkpoints (`training.checkpoint_every`),
the run pauses: this worker drops the cut-short iteration, joins a new recovery generation
(`recovery.py`), waits for a replacement to take the slot, restores the newest checkpoint every slot
has and trains on from there. Without checkpoints, or when no replacement comes within
`training.recovery_timeout_s`, it publishes `WorkerFailed` naming the slot and stops with an error
instead of waiting forever for tensors that will never come.
"""

from __future__ import annotations

import asyncio
import sys
import time

import msgspec
import torch

from services.stage_worker.filler import Filler
from services.stage_worker.lease import RunStopped, Slot, SlotError, SlotLease
from services.stage_worker.mailbox import Mailbox
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.recovery import CheckpointStore, Generations
from services.stage_worker.runner import Profile, StageRunner
from services.stage_worker.trainer import StageTrainer
from shared import keys
from shared.bus import Bus, Consumer, Delivery, Reject
from shared.bus.connection import TRANSIENT_ERRORS, Outage
from shared.config import ClusterSpec
from shared.devices import DeviceError, check_kind, describe, select_device, slot_index, synchronize
from shared.health import Heartbeat, instance_id
from shared.logs import get_logger
from shared.model.data import ByteCorpus
from shared.model.prefill import PrefillModel
from shared.plan import placement_of, predict, profile_ms
from shared.policies.bubbles import BubblePredictor
from shared.policies.fill import FillPolicy
from shared.policies.placement import Placement
from shared.policies.prefill_cost import PrefillProfile
from shared.policies.recovery import FROM_SCRATCH
from shared.service import EXIT_CONFIG
from shared.settings import Settings
from shared.telemetry import MetricsServer
from shared.tensors import from_blob
from shared.wire import GradShard, PrefillBatch, StageTensor, WorkerFailed

SERVICE = "stage_worker"
#: How long a worker waits for all its peers to lease their slots.
START_TIMEOUT_S = 180.0
SWITCH_INTERVAL_S = 0.0005
#: Prefill batches a worker holds at once (one bubble's worth; more simply wait in the stream).
FILL_CONCURRENCY = 8
#: Data seed of the start-up timing probe (kept apart from the training data seed).
TIMING_SEED = 0x5EED

log = get_logger(__name__)


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    try:  # before anything is leased: `device.kind: cuda` on a machine without CUDA stops here
        kind = check_kind(settings.spec.device.kind)
    except DeviceError as exc:
        log.error("cannot start: the configured device is not available", error=str(exc))
        raise SystemExit(EXIT_CONFIG) from None
    if kind == "cpu":
        torch.set_num_threads(1)  # several workers share the machine's cores
    # A prefill thread holds the GIL between torch ops; the default 5 ms switch interval would
    # let it delay the event loop's handling of an arriving activation by that much. 0.5 ms
    # bounds how late the loop notices training input (and so how late prefill yields).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    spec, run = settings.spec, settings.run
    placement = placement_of(spec)  # an infeasible spec fails here, naming the missing GPUs
    async with Bus(settings.require_redis_url(), spec.bus, name=SERVICE) as bus:
        lease = SlotLease(
            bus.redis,
            run,
            spec.parallelism.pp,
            spec.parallelism.dp,
            holder=instance_id(),
            recoverable=spec.training.recovers,
        )
        # A replacement may start before its dead predecessor's lease expired: it waits that long.
        slot = await lease.acquire(wait_s=keys.LEASE_TTL_MS / 1000 + 1 if spec.training.recovers else 0.0)
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
        hb = Heartbeat(bus.redis, SERVICE, f"{run}-{slot.name}", lambda: info)
        await hb.start()
        watch = asyncio.create_task(lease.watch(), name="lease")  # renews from now on
        try:
            await _train(bus, settings, placement, lease, watch, slot, stop, metrics, device)
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
) -> None:
    spec, run = settings.spec, settings.run
    corpus = await asyncio.to_thread(ByteCorpus.from_stdlib)
    trainer = await asyncio.to_thread(StageTrainer, spec, slot.replica, slot.stage, corpus, device)
    profile, prior = await asyncio.to_thread(_profile_and_prior, spec, slot, trainer)
    mailbox = Mailbox()
    gens = Generations(bus.redis, run, lease.all_slots)

    def current(m: StageTensor | GradShard) -> bool:
        """Whether `m` belongs to this run's current generation (else it is dropped: it was sent
        before the run resumed from a checkpoint)."""
        if m.run != run:
            raise Reject(f"the inbox of run {run} got a {type(m).__name__} of run {m.run}")
        return m.generation == gens.current

    async def on_tensor(d: Delivery) -> None:
        m = d.message
        assert isinstance(m, StageTensor)
        if current(m):
            mailbox.put((m.what, m.iteration, m.microbatch), from_blob(m.tensor))

    async def on_shard(d: Delivery) -> None:
        m = d.message
        assert isinstance(m, GradShard)
        if current(m):
            mailbox.put(("shard", m.iteration, m.replica), (from_blob(m.tensor), m.ready_at))

    memory = int(spec.device.memory_gib * (1 << 30))
    prefill = None
    if spec.bubbletea.enabled:
        prefill = await asyncio.to_thread(_prefill_model, spec, device)
        memory -= model_bytes(prefill)  # the guest's weights live beside the owner's
    runner = StageRunner(
        bus,
        spec,
        run,
        slot,
        placement,
        trainer,
        mailbox,
        BubblePredictor(prior),
        profile,
        free_memory_bytes=max(0, memory - trainer.state_bytes()),
        metrics=metrics,
        checkpoints=CheckpointStore(bus.redis, run, lease.all_slots) if spec.training.recovers else None,
    )
    inbox = bus.consumer(
        keys.inbox(run, slot.replica, slot.stage),
        "worker",
        {StageTensor: on_tensor, GradShard: on_shard},
        name=slot.name,
    )
    metrics.streams.add(inbox)
    fill = None
    if prefill is not None:
        runner.filler = Filler(
            bus,
            run,
            slot.name,
            prefill,
            spec.prefill.model_name,
            spec.prefill.kv_ttl_s,
            runner.prefill_span,
            FillPolicy(guard_s=spec.bubbletea.guard_ms / 1000),
            PrefillProfile.from_device(spec.device.prefill_ms_per_layer, spec.device.prefill_us_per_token),
            metrics,
            kv_budget_mb=spec.prefill.kv_budget_mb,
        )
        fill = bus.consumer(
            keys.fill_stream(run, slot.replica, slot.stage),
            "worker",
            {PrefillBatch: runner.filler.on_batch},
            name=slot.name,
            config=msgspec.structs.replace(spec.bus, concurrency=FILL_CONCURRENCY),
        )
        metrics.streams.add(fill)
        await fill.start()
    try:
        await _run(runner, inbox, lease, watch, gens, stop)
    finally:
        runner.close()
        if runner.filler is not None:
            await runner.filler.close()  # answer and report what already ran
        if fill is not None:
            # A batch still unreported stays pending; the dispatcher requeues it when no report comes.
            await fill.stop(grace_s=1.0)


async def _run(
    runner: StageRunner,
    inbox: Consumer,
    lease: SlotLease,
    watch: asyncio.Task[None],
    gens: Generations,
    stop: asyncio.Event,
) -> None:
    """Join the run, train; after a lost peer, join again and resume, until the end or a stop."""
    slot, tr = runner.slot, runner.spec.training
    async with inbox:
        stopping = asyncio.create_task(stop.wait(), name="stop")
        crashed = asyncio.create_task(inbox.crashed.wait(), name="inbox")
        try:
            after_loss = False
            while True:
                start = await _join(runner, lease, watch, gens, stopping, after_loss=after_loss)
                if start is None:  # told to stop while waiting for the peers (they may never come)
                    log.info("stopped before training started", slot=slot.name)
                    await lease.mark_stopped(f"slot {slot.name} was stopped before training started")
                    return
                log.info("all slots held; training", slot=slot.name, iterations=tr.iterations, start=start)
                train = asyncio.create_task(runner.run_all(start), name="train")
                lost = asyncio.create_task(lease.peer_lost.wait(), name="lost")
                # a run without checkpoints does not resume: only a lost lease ends it
                watch_generation = _generation_moved(gens) if tr.recovers else asyncio.Event().wait()
                moved = asyncio.create_task(watch_generation, name="moved")
                done, _ = await asyncio.wait(
                    {train, watch, stopping, crashed, lost, moved}, return_when=asyncio.FIRST_COMPLETED
                )
                for t in (train, lost, moved):
                    t.cancel()
                await asyncio.gather(train, lost, moved, return_exceptions=True)
                if train in done:
                    train.result()  # re-raise a training error
                    await runner.outbox.close()
                    await _save_weights_if_asked(runner)
                    await lease.finish()
                    log.info(
                        "training finished",
                        slot=slot.name,
                        iterations=tr.iterations,
                        over_predicted_bubbles=round(runner.predictor.over_predicted_share(), 3),
                    )
                    return
                if watch in done:
                    watch.result()  # raises SlotError naming the slot
                if crashed in done:
                    raise RuntimeError(f"inbox consumer crashed: {inbox.error!r}")
                if stopping in done:
                    log.info("stopped before the end of training", slot=slot.name, iteration=runner.iteration)
                    await lease.mark_stopped(f"slot {slot.name} was stopped at iteration {runner.iteration}")
                    return
                log.warning(
                    "the run pauses to recover: iteration cut short",
                    slot=slot.name,
                    iteration=runner.iteration,
                    generation=gens.current,
                    why="a peer lost its worker" if lost in done else "a replacement joined the run",
                )
                after_loss = True
        finally:
            for t in (stopping, crashed):
                t.cancel()
            await runner.outbox.close()


async def _join(
    runner: StageRunner,
    lease: SlotLease,
    watch: asyncio.Task[None],
    gens: Generations,
    stopping: asyncio.Task[bool],
    *,
    after_loss: bool,
) -> int | None:
    """Join a new generation and wait for every slot; restore the checkpoint it resumes from.
    Returns the iteration to train from, or None if told to stop meanwhile."""
    slot, tr = runner.slot, runner.spec.training

    def enter(gen: int) -> None:  # before anything of the new generation can arrive
        runner.mailbox.reset()
        runner.enter_generation(gen)

    lease.check_peers = False
    enter(await gens.enter(after_loss=after_loss))
    timeout = tr.recovery_timeout_s if after_loss else START_TIMEOUT_S
    barrier = asyncio.create_task(gens.barrier(slot, timeout, on_enter=enter), name="barrier")
    await asyncio.wait({barrier, watch, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not barrier.done():
        barrier.cancel()
        await asyncio.gather(barrier, return_exceptions=True)
        if watch.done():
            watch.result()  # our own lease was lost: raises SlotError
        return None  # told to stop
    gen = barrier.result()
    store = runner.checkpoints
    resume = await gens.resume_point(store) if store is not None else FROM_SCRATCH
    if after_loss or resume != FROM_SCRATCH:
        blob = None if store is None or resume == FROM_SCRATCH else await store.load(slot, resume)
        try:
            await runner.in_torch_thread(runner.trainer.restore, blob)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise SlotError(
                f"slot {slot.name} cannot restore the checkpoint of iteration {resume} of run {runner.run} "
                f"({exc}); it was written for another spec: start a new run id (BUBBLETEA_RUN)"
            ) from None
    lease.peer_lost.clear()
    lease.check_peers = True
    log.info("joined the run", slot=slot.name, generation=gen, resume_after=resume)
    return resume + 1


async def _generation_moved(gens: Generations) -> None:
    """Return once the run's generation moved past ours (a replacement joined: the run resumes)."""
    outage = Outage(f"generation watch of run {gens.run}")
    while True:
        await asyncio.sleep(keys.LEASE_RENEW_S)  # a counter in Redis: nothing to block on
        try:
            newest = await gens.read()
        except TRANSIENT_ERRORS as exc:
            await asyncio.sleep(outage.failed(exc))
            continue
        outage.ok()
        if newest > gens.current:
            return


async def _save_weights_if_asked(runner: StageRunner) -> None:
    """At the end of training, if the run was asked to save (`bubbletea train --save`), replica 0
    of each stage leaves its stage's weights in Redis, named as in the full model, for the launcher
    to assemble (every replica holds the same weights after the all-reduce)."""
    r = runner.bus.redis
    if runner.replica != 0 or not await r.exists(keys.save_request_key(runner.run)):
        return
    from safetensors.torch import save

    model = runner.trainer.model
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.global_named_parameters()}
    await r.set(keys.weights_key(runner.run, runner.stage), save(tensors), ex=keys.WEIGHTS_TTL_S)
    log.info("weights saved for the launcher", slot=runner.slot.name, tensors=len(tensors))


def _prefill_model(spec: ClusterSpec, device: torch.device) -> PrefillModel:
    """The guest model, on this worker's device (it creates its inputs where its weights are)."""
    model = PrefillModel.from_spec(spec.prefill)
    model.module.to(device)
    return model


def model_bytes(model: PrefillModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.module.parameters())


def _profile_and_prior(spec: ClusterSpec, slot: Slot, trainer: StageTrainer) -> tuple[Profile, dict[int, float]]:
    """The device profile, and the analytic model's bubble lengths for this slot (the prediction
    before any history). Without a profile, per-layer times are measured on this stage."""
    dev = spec.device
    prof = profile_ms(spec)
    if prof is not None:
        fwd_ms, bwd_ms = prof
        layers = len(trainer.model.blocks)
        profile = Profile(
            fwd=fwd_ms * layers / 1000,
            bwd=bwd_ms * layers / 1000,
            allreduce=dev.allreduce_ms / 1000,
            step=dev.step_ms / 1000,
        )
    else:
        fwd_ms, bwd_ms = _measure_ms_per_layer(trainer)
        profile = Profile(allreduce=dev.allreduce_ms / 1000)
    result = predict(spec, fwd_ms, bwd_ms, iterations=2)
    prior = {
        b.position: b.length
        for b in result.bubbles
        if (b.replica, b.stage, b.iteration) == (slot.replica, slot.stage, 1)
    }
    return profile, prior


def _measure_ms_per_layer(trainer: StageTrainer, reps: int = 3) -> tuple[float, float]:
    """Time this stage's forward and backward on a real microbatch (after a warm-up pass), on its
    device (synchronised, so a GPU's time is measured and not its kernel launches)."""
    cfg, dev = trainer.cfg, trainer.device
    layers = max(1, len(trainer.model.blocks))
    fwd, bwd = [], []
    for i in range(reps + 1):
        x, _ = trainer.corpus.batch(0, i, trainer.mbs, trainer.seq, seed=TIMING_SEED)  # not a training batch
        inp: torch.Tensor = (
            x.to(dev)
            if trainer.model.is_first
            else torch.randn(trainer.mbs, trainer.seq, cfg.d_model, device=dev, requires_grad=True)
        )
        synchronize(dev)
        t0 = time.perf_counter()
        out = trainer.model(inp)
        synchronize(dev)
        t1 = time.perf_counter()
        out.float().mean().backward()
        synchronize(dev)
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    trainer.model.zero_grad(set_to_none=True)
    return min(fwd) * 1000 / layers, min(bwd) * 1000 / layers
