"""`bubbletea train`: one training run over live services (broker + one worker per slot).

Starts the wan_broker and PP x DP stage workers as processes on the given Redis, follows the
run's events stream until every worker has finished every iteration, then stops the broker.
A worker that exits with an error or reports `WorkerFailed` ends the run with that reason.

Over 300 lines on purpose: one run's life (checks, processes, the events it follows, the save it
writes), each part used only here.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from bubbletea.launcher.procs import Proc, ServiceFailed, spawn, stop_all
from bubbletea.launcher.services import DISPATCHER, STAGE_WORKER, WAN_BROKER, instances
from bubbletea.launcher.wan_modes import worker_launches
from bubbletea.progress import StepBar, say
from shared.bus import Bus
from shared.config.settings import Settings
from shared.config.spec import ConfigError
from shared.config.training import UNTIL_STOPPED
from shared.figures.training import steady_iteration_s
from shared.model.trainstate import check_resume, check_save_target, write_save
from shared.policies.recovery import clean_stop_iteration, save_due
from shared.runtime.logs import get_logger
from shared.wire import IterationDone, LinkReport, WorkerFailed, decode, keys

log = get_logger(__name__)

#: The least time a clean stop waits for the workers to finish their last iteration and hand it over.
CLEAN_STOP_MIN_S = 30.0

#: A run that makes no progress for this long is declared stuck (a generous bound on one iteration).
STALL_TIMEOUT_S = 300.0


@dataclass
class TrainResult:
    run: str
    iterations: int
    #: the first iteration this run trained (after `--resume`: the one after the save's)
    first: int = 0
    #: tokens one iteration trains on (DP x microbatches x microbatch size x sequence length)
    tokens_per_iteration: int = 0
    #: per iteration: mean over replicas of the last stage's mean microbatch loss
    losses: list[float] = field(default_factory=list)
    #: per iteration: wall time from the previous iteration's end (or the first start) to its end
    iteration_s: list[float] = field(default_factory=list)
    lag_ms: float = 0.0
    prefill_lag_ms: float = 0.0
    links: dict[str, dict[str, float]] = field(default_factory=dict)

    def steady_iteration_s(self) -> float:
        """Median iteration time, leaving out the first (warm-up) iteration when there are several."""
        return steady_iteration_s(self.iteration_s)


async def run_training(
    settings: Settings,
    redis_url: str,
    *,
    out: TextIO = sys.stdout,
    progress: bool = True,
    quiet: bool = False,
    dispatcher: bool = False,
    save: Path | None = None,
    resume: Path | None = None,
    until: asyncio.Future[Any] | None = None,
    record: TextIO | None = None,
    label: str = "training",
) -> TrainResult:
    """Train once over live services. With `dispatcher`, a BubbleTea dispatcher for the run is
    started too, so prefill requests queued on the same Redis are served in the run's bubbles.
    With `save`, the trained model is written there (`shared.model.trainstate`: a Hugging Face
    directory that `prefill.checkpoint` and transformers load, plus the optimizer state) after every
    `training.save_every` iterations and after the last. With `resume`, a directory such a save
    wrote, training continues after its iteration up to `training.iterations` (the total). With
    `record`, each iteration is also written there as a JSON line (`iteration_record`). With
    `progress`, each iteration is a line on `out` and, when `out` is a terminal, a bar named `label`
    counts the iterations done against the spec's and the time left (`bubbletea.progress`).

    With `until`, the workers go on training past the spec's iterations until `until` is done
    (the demo's prefill load, however late it got going, is served by a training run rather than
    refused because the run ended first); the result still covers the spec's iterations."""
    spec, run = settings.spec, settings.run
    if spec.training.iteration_limit is None:
        raise ConfigError(
            f"training.iterations is {spec.training.iterations!r}: this job trains a number of iterations; set "
            "one in the spec or with BUBBLETEA_ITERATIONS (a run that trains until stopped is `bubbletea up`)"
        )
    first = 0 if resume is None else check_resume(resume, spec) + 1  # a save that does not fit fails here
    if save is not None:
        check_save_target(save)
    env = {
        "REDIS_URL": redis_url,
        "BUBBLETEA_CONFIG": str(settings.spec_path),
        "BUBBLETEA_RUN": run,
        "BUBBLETEA_LOG_LEVEL": settings.log_level,
        "BUBBLETEA_STATE_DIR": str(settings.state_dir),  # checkpoints and the save's hand-over files
    }
    if resume is not None:
        env["BUBBLETEA_RESUME"] = str(resume)  # absolute (the CLI makes it so): the workers' cwd may differ
    if until is not None:
        env["BUBBLETEA_ITERATIONS"] = UNTIL_STOPPED  # stopped by `stop_all` below once `until` is done
        if spec.training.decay_iters is None:
            # the learning rate still decays over the spec's iterations (a run with no end keeps
            # `lr`): the spec's iterations train as they would without `until`, bit for bit
            env["BUBBLETEA_DECAY_ITERS"] = str(spec.training.iteration_limit)
    procs: list[Proc] = []
    async with Bus(redis_url, spec.bus, name="train-launcher") as bus:
        events = keys.events_stream(run)
        if save is not None:
            await bus.redis.set(keys.save_request_key(run), "1", ex=keys.WEIGHTS_TTL_S)
        saver: asyncio.Task[None] | None = None
        finished = False
        reached = Progress(first - 1)
        async with worker_launches(settings, redis_url) as launches:
            try:
                procs.append(await spawn(WAN_BROKER, env, out=out, quiet=quiet))
                if dispatcher:  # one, or one per datacenter (`bubbletea.dispatch: per_dc`)
                    for _, d in instances(DISPATCHER, spec, []):
                        procs.append(await spawn(DISPATCHER, {**env, **d.env}, out=out, quiet=quiet))
                for w in launches:  # in kernel mode: inside their datacenter's namespace
                    procs.append(await spawn(STAGE_WORKER, {**env, **w.env}, out=out, quiet=quiet, prefix=w.prefix))
                if save is not None:
                    saver = asyncio.create_task(_saver(bus, settings, procs, save, first, out if progress else None))
                try:
                    shown = out if progress else None
                    with StepBar((spec.training.iteration_limit or 0) - first, label, shown) as bar:
                        result = await _follow(bus, events, settings, procs, bar, until, first, record, reached)
                    if saver is not None:  # the last iteration's save, which the workers hand over last
                        await saver
                    finished = True
                finally:
                    if saver is not None and not saver.done():
                        saver.cancel()
                        await asyncio.gather(saver, return_exceptions=True)
                return result
            except asyncio.CancelledError:  # Ctrl-C (or SIGTERM): with --save, stop cleanly and save
                if save is not None and not finished and procs:
                    await _clean_stop(bus, settings, procs, save, reached)
                raise
            finally:
                await stop_all(procs)
                if save is not None:  # what an unfinished save left (each a stage's whole state)
                    await _drop_save_keys(bus, run)


async def _saver(
    bus: Bus, settings: Settings, procs: list[Proc], directory: Path, first: int, out: TextIO | None
) -> None:
    """Write the save directory after each saved iteration, from the stages' states the replica-0
    workers hand over (files, their paths in Redis: `StatePort.hand_over`), in iteration order,
    until the last."""
    tr = settings.spec.training
    limit = tr.iteration_limit
    assert limit is not None
    for it in (i for i in range(first, limit) if save_due(i, tr.save_every, limit)):
        await _write_iteration(bus, settings, directory, it, procs)
        if out is not None:
            say(f"saved iteration {it} to {directory}", out)
    await bus.redis.delete(keys.save_request_key(settings.run))


async def _write_iteration(bus: Bus, settings: Settings, directory: Path, it: int, procs: list[Proc]) -> None:
    """Wait for every stage's state after iteration `it` (the paths of the files the workers wrote,
    on this host: this launcher started them), write the save directory, drop the keys and files."""
    from safetensors.torch import load

    from shared.model.export import save_gpt2_checkpoint, save_hf_checkpoint
    from shared.model.shape import GPTConfig
    from shared.model.training import config_json

    spec, run = settings.spec, settings.run
    stages = spec.parallelism.pp
    wanted = [keys.weights_key(run, it, s) for s in range(stages)]
    wanted += [keys.train_state_key(run, it, s) for s in range(stages)]
    paths = [Path(p.decode()) for p in await _wait_for_keys(bus, procs, wanted, f"the state of iteration {it}")]
    found = await asyncio.to_thread(lambda: [p.read_bytes() for p in paths])
    weights: dict[str, Any] = {}
    for raw in found[:stages]:
        weights.update(load(raw))

    def write_model(d: Path) -> None:
        if spec.training.model is not None:  # the workers named the tensors as the checkpoint stores them
            save_hf_checkpoint(weights, config_json(spec), spec.training.model, d)
        else:
            save_gpt2_checkpoint(weights, GPTConfig.from_spec(spec.model), d)

    await asyncio.to_thread(write_save, directory, spec, it, write_model, found[stages:])
    await bus.redis.delete(*wanted)
    await asyncio.to_thread(_unlink, paths)


@dataclass
class Progress:
    """The newest iteration any worker reported finished, and how long the slowest took."""

    newest: int
    iteration_s: float = 0.0


async def _clean_stop(bus: Bus, settings: Settings, procs: list[Proc], directory: Path, progress: Progress) -> None:
    """Told to stop under `--save`: ask every worker to finish one iteration a little ahead
    (`clean_stop_iteration`), hand its state over and stop; write that save. A second Ctrl-C stops
    at once (the last save stays)."""
    limit = settings.spec.training.iteration_limit
    assert limit is not None
    stop_at = clean_stop_iteration(progress.newest, limit)
    await bus.redis.set(keys.stop_after_key(settings.run), stop_at, ex=keys.WEIGHTS_TTL_S)
    print(f"==> stopping after iteration {stop_at} to save it (Ctrl-C again to stop at once)", flush=True)
    timeout = max(CLEAN_STOP_MIN_S, 4 * progress.iteration_s)
    try:
        await asyncio.wait_for(_write_iteration(bus, settings, directory, stop_at, procs), timeout)
    except (TimeoutError, ServiceFailed) as exc:
        log.warning(
            "the clean stop did not save", iteration=stop_at, error=str(exc) or "timed out", kept=str(directory)
        )
        return
    print(f"==> stopped: saved iteration {stop_at} to {directory}", flush=True)


async def _drop_save_keys(bus: Bus, run: str) -> None:
    """The keys a save left, and the handed-over files they name."""
    stale = [keys.save_request_key(run), keys.stop_after_key(run)]
    states: list[Any] = []
    for pattern in keys.saved_state_patterns(run):
        states += [k async for k in bus.redis.scan_iter(match=pattern)]
    paths: list[Any] = await bus.redis.mget(states) if states else []
    await bus.redis.delete(*stale, *states)
    await asyncio.to_thread(_unlink, [Path(p.decode()) for p in paths if p is not None])


def _unlink(paths: list[Path]) -> None:
    """Delete handed-over files, and the folders above them (<run>/save/<iteration>) left empty."""
    for p in paths:
        p.unlink(missing_ok=True)
        for folder in p.parents[:3]:
            try:
                folder.rmdir()
            except OSError:  # not empty (another stage's files, the run's checkpoints), or gone
                break


async def _wait_for_keys(bus: Bus, procs: list[Proc], wanted: list[str], what: str) -> list[bytes]:
    """The values of `wanted` once all are there; fails if a worker exits with an error first."""
    while True:
        found: Any = await bus.redis.mget(wanted)
        if all(f is not None for f in found):
            return list(found)
        for p in procs:
            if p.proc.returncode not in (None, 0):
                raise ServiceFailed(f"{p.name} exited with code {p.proc.returncode} before handing over {what}")
        await asyncio.sleep(0.1)  # keys the workers write once: poll them


async def _follow(
    bus: Bus,
    stream: str,
    settings: Settings,
    procs: list[Proc],
    bar: StepBar,
    until: asyncio.Future[Any] | None,
    first: int = 0,
    record: TextIO | None = None,
    progress: Progress | None = None,
) -> TrainResult:
    spec = settings.spec
    limit, workers = spec.training.iteration_limit or 0, spec.parallelism.pp * spec.parallelism.dp
    tr = spec.training
    tokens = spec.parallelism.dp * tr.microbatches * tr.microbatch_size * spec.model.seq_len
    # per iteration, per slot: the newest generation's report (a run that resumed from a checkpoint
    # trains some iterations again)
    done: dict[int, dict[tuple[int, int], IterationDone]] = {}
    result = TrainResult(settings.run, limit - first, first, tokens)
    last_progress = time.monotonic()
    cursor = "0"  # the run's events from the beginning

    def finished() -> bool:
        trained = sum(len(done.get(i, ())) for i in range(first, limit)) == (limit - first) * workers
        return trained and (until is None or until.done())

    while not finished():
        for p in procs:
            if p.proc.returncode not in (None, 0):
                raise ServiceFailed(
                    f"{p.name} (pid {p.proc.pid}) exited with code {p.proc.returncode}; last output:\n"
                    + "\n".join(p.tail)
                )
        if time.monotonic() - last_progress > STALL_TIMEOUT_S:
            raise ServiceFailed(f"run {settings.run} made no progress for {STALL_TIMEOUT_S:.0f}s")
        reply: Any = await bus.redis.xread({stream: cursor}, count=500, block=500)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                cursor = entry_id.decode()
                msg = decode(fields[b"m"])
                if isinstance(msg, WorkerFailed):
                    raise ServiceFailed(f"worker {msg.slot} failed: {msg.reason}")
                if isinstance(msg, LinkReport):
                    result.links[f"{msg.src_dc}->{msg.dst_dc}"] = {
                        "utilization": msg.utilization,
                        "late_p99_ms": msg.late_p99_ms,
                        "bytes_sent": msg.bytes_sent,
                        "busy_s": msg.busy_s,
                    }
                if isinstance(msg, IterationDone):
                    last_progress = time.monotonic()
                    slots = done.setdefault(msg.iteration, {})
                    had = slots.get((msg.replica, msg.stage))
                    if had is None or had.generation <= msg.generation:
                        slots[(msg.replica, msg.stage)] = msg
                    if progress is not None and msg.iteration > progress.newest:
                        progress.newest = msg.iteration
                    if had is None and len(slots) == workers:
                        line = iteration_record(msg.iteration, done, tokens)
                        if progress is not None:
                            progress.iteration_s = max(progress.iteration_s, line["seconds"])
                        _report_iteration(bar, record, line)
                        if first <= msg.iteration < limit:
                            bar.advance()
    prev_end = min(m.started for m in done[first].values())
    for i in range(first, limit):
        recs = list(done[i].values())
        end = max(m.ended for m in recs)
        result.iteration_s.append(end - prev_end)
        prev_end = end
        result.losses.append(statistics.fmean(m.loss for m in recs if m.loss is not None))
        result.lag_ms += sum(m.lag_ms for m in recs)
        result.prefill_lag_ms += sum(m.prefill_lag_ms for m in recs)
    return result


def _slot_of(p: Proc) -> str:
    """The slot a worker process leased, from its log ("" if none)."""
    for line in p.tail:
        if m := re.search(r"slot leased.*slot=(r\d+s\d+)", line):
            return f"of slot {m.group(1)} "
    return ""


def iteration_record(i: int, done: dict[int, dict[tuple[int, int], IterationDone]], tokens: int) -> dict[str, Any]:
    """Iteration `i` once every slot reported it: its mean loss, wall time (from the previous
    iteration's end, or its own first start) and tokens per second."""
    recs = list(done[i].values())
    losses = [m.loss for m in recs if m.loss is not None]
    end = max(m.ended for m in recs)
    start = max(m.ended for m in done[i - 1].values()) if i - 1 in done else min(m.started for m in recs)
    seconds = max(end - start, 1e-9)
    return {"iteration": i, "loss": statistics.fmean(losses), "seconds": seconds, "tokens_per_s": tokens / seconds}


def _report_iteration(bar: StepBar, sink: TextIO | None, record: dict[str, Any]) -> None:
    bar.line(
        f"iteration {record['iteration']:4d}  loss {record['loss']:.4f}  time {record['seconds'] * 1000:8.1f} ms  "
        f"{record['tokens_per_s']:9.0f} tokens/s"
    )
    if sink is not None:
        sink.write(json.dumps(record) + "\n")
        sink.flush()
