"""Training survives a lost worker: kill -9 one, start a replacement, and the run resumes from the
newest common checkpoint with exactly the losses of a run that never stopped: a run of a number of
iterations, and one that trains until stopped (as `bubbletea up` runs it) with its learning-rate
horizon, checked as bench/chaos.py checks it.

The broker and PP x DP stage workers run as real processes over a real redis-server; the
reference trains the full model in this process on the same global batches.
"""

from __future__ import annotations

import asyncio
import io
import re
import statistics
import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bench import chaos
from bubbletea.launcher.procs import Proc, spawn, stop_all
from bubbletea.launcher.services import STAGE_WORKER, WAN_BROKER
from shared.bus.connection import blocking_client
from shared.control import keys
from shared.model.reference import train_reference_for
from shared.runtime.redis_server import EmbeddedRedis
from shared.spec.settings import load_settings
from shared.wire import IterationDone, decode
from tests.e2e.test_training_correctness import ONE_REPLICA, write_spec

#: Far more than the kill point (iteration 4), so the run is still training when the kill lands
#: however late this process reads the event on a busy machine.
ITERATIONS = 12
#: The until-stopped run's cosine learning rate ends here (`decay_iters`, what `bubbletea up` gets
#: from BUBBLETEA_DECAY_ITERS): past the kill point, so the resumed iterations see the rate change.
HORIZON = 8


async def start_run(url: str, path: Path) -> tuple[str, dict[str, str], list[Proc]]:
    """The broker and one stage worker per slot (PP x DP) on the spec at `path`."""
    run = f"rec{uuid.uuid4().hex[:6]}"
    env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_RUN": run}
    par = load_settings(path, env={}).spec.parallelism
    procs = [await spawn(WAN_BROKER, env, out=io.StringIO())]
    procs += [await spawn(STAGE_WORKER, env, out=io.StringIO()) for _ in range(par.pp * par.dp)]
    return run, env, procs


async def kill_a_worker_and_replace_it(r: Redis, run: str, env: dict[str, str], procs: list[Proc]) -> tuple[str, str]:
    """Once some worker finished iteration 4 (checkpoints of iterations 1 and 3 exist), kill -9 the
    first worker and start a replacement (appended to `procs`). Returns the victim's slot and the
    events stream's cursor as of the kill (what was reported before it)."""
    cursor = "0"
    while True:
        reply = await r.xread({keys.events_stream(run): cursor}, block=120_000)
        assert reply, "training never got to iteration 4"
        cursor = reply[0][1][-1][0]
        if any(isinstance(m := decode(f[b"m"]), IterationDone) and m.iteration >= 4 for _, f in reply[0][1]):
            break
    victim = procs[1]
    slot = next(m.group(1) for line in victim.tail if (m := re.search(r"slot leased.*slot=(r\d+s\d+)", line)))
    assert victim.proc.returncode is None, "the victim finished training before it could be killed"
    victim.proc.kill()
    await victim.proc.wait()
    procs.append(await spawn(STAGE_WORKER, env, out=io.StringIO()))
    return slot, cursor


async def test_a_replaced_worker_resumes_the_run_with_uninterrupted_losses(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    path = write_spec(tmp_path, iterations=ITERATIONS, checkpoint_every=2)
    run, env, procs = await start_run(redis_server.url, path)
    r = blocking_client(redis_server.url)  # no socket timeout cutting the long blocking reads
    try:
        slot, _ = await kill_a_worker_and_replace_it(r, run, env, procs)
        replacement = procs[-1]
        workers = [*procs[2:5], replacement]
        codes = await asyncio.wait_for(asyncio.gather(*(p.proc.wait() for p in workers)), 240)
        assert codes == [0, 0, 0, 0], "\n".join(line for p in workers for line in p.tail[-10:])
        # the replacement took the victim's slot (its last lines: the lease line is further up)
        joined = [line for line in replacement.tail if "joined the run" in line]
        assert joined and f"slot={slot}" in joined[-1], "\n".join(replacement.tail)
        for p in procs[2:5]:  # the survivors paused and resumed rather than failing
            assert any("the run pauses to recover" in line for line in p.tail), "\n".join(p.tail)

        events = [decode(f[b"m"]) for _, f in await r.xrange(keys.events_stream(run))]
    finally:
        await r.aclose()
        await stop_all(procs)

    done = [m for m in events if isinstance(m, IterationDone)]
    newest: dict[tuple[int, int, int], IterationDone] = {}
    for m in done:  # the newest generation's report of each (iteration, replica, stage)
        k = (m.iteration, m.replica, m.stage)
        if k not in newest or newest[k].generation <= m.generation:
            newest[k] = m
    assert len(done) > len(newest), "no iteration was trained again: the run did not resume from a checkpoint"
    resumed = {m.iteration for m in newest.values() if m.generation > min(x.generation for x in done)}
    # A worker that finished iteration 4 implies every worker stepped iteration 3 (the pipeline and
    # the all-reduce join them), so the newest common checkpoint is at least iteration 3's. Which
    # later one it is depends on how far the run got before this process read the event and
    # killed: any checkpoint (every 2 iterations: 1, 3, 5, ...) from 3 on is right.
    assert min(resumed) >= 4 and min(resumed) % 2 == 0, f"resumed at iteration {min(resumed)}: not after a checkpoint"

    losses = [
        statistics.fmean(m.loss for (i, _, _), m in newest.items() if i == it and m.loss is not None)
        for it in range(ITERATIONS)
    ]
    expected, _ = train_reference_for(load_settings(path, env={}).spec)
    assert losses == pytest.approx(expected, abs=1e-5)


async def test_a_run_trained_until_stopped_resumes_on_its_learning_rate_schedule(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """`bubbletea up`'s training (until stopped, the cosine ending at its horizon) resumed after a
    lost worker trains what an uninterrupted run does, as bench/chaos.py checks it: the run's losses
    against the reference of the spec the run trained, over its first iterations."""
    # one replica: the schedule on resume is the subject (the replicas' rejoin: the test above)
    path = write_spec(tmp_path, ONE_REPLICA, iterations="until_stopped", decay_iters=HORIZON, checkpoint_every=2)
    spec = load_settings(path, env={}).spec
    run, env, procs = await start_run(redis_server.url, path)
    r = blocking_client(redis_server.url)
    try:
        _, cursor = await kill_a_worker_and_replace_it(r, run, env, procs)
        killed_in = max(m.generation for m in await done_reports(r, run, "-", cursor))
        # train on until every replica's losses in the resumed generation reach past the horizon
        reached: dict[int, int] = {}
        while len(reached) < spec.parallelism.dp or min(reached.values()) <= HORIZON:
            reply = await r.xread({keys.events_stream(run): cursor}, block=120_000)
            assert reply, f"the resumed run stalled: {reached}"
            cursor = reply[0][1][-1][0]
            for _, f in reply[0][1]:
                if isinstance(m := decode(f[b"m"]), IterationDone) and m.loss is not None and m.generation > killed_in:
                    reached[m.replica] = max(reached.get(m.replica, -1), m.iteration)
        done = await done_reports(r, run, "-", "+")
    finally:
        await r.aclose()
        await stop_all(procs)

    figures = chaos.training_figures(done, spec)
    # resumed from a checkpoint (a new generation trained on). Nothing need be trained twice: on a
    # busy machine the kill may land after the newest checkpoint's iteration and before any later
    # one was reported (a make test run, 2026-11-28, saw 0)
    assert figures["training_resumed"] and figures["generations"] >= 2, figures
    assert figures["iterations_checked"] > HORIZON + 1, figures  # the decay and the floor after it
    assert figures["losses_equal"], figures
    assert chaos.verdict(figures, lost=0, duplicated=0, up_exit_code=0)["valid"]


async def done_reports(r: Redis, run: str, first: str, last: str) -> list[IterationDone]:
    return [
        m
        for _, f in await r.xrange(keys.events_stream(run), first, last)
        if isinstance(m := decode(f[b"m"]), IterationDone)
    ]
