"""A worker told to leave (a drain: `bubbletea drain SLOT`, or SIGTERM from an orchestrator) finishes
the iteration in progress, hands its slot over and exits 0; the run goes on with a replacement,
nothing trained twice, losses those of an uninterrupted run. SIGTERM to every worker at once (compose
down, scancel, a deleted StatefulSet) still stops the whole run.

The broker and PP x DP stage workers run as real processes over a real redis-server.
"""

from __future__ import annotations

import asyncio
import io
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bubbletea.commands import build_parser
from bubbletea.launcher.procs import Proc, spawn, stop_all
from bubbletea.launcher.services import STAGE_WORKER
from shared.bus.connection import blocking_client
from shared.config.settings import load_settings
from shared.control.leases import read_slots
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import IterationDone, decode, keys
from shared.wire.status import LeaseState
from tests.e2e.test_training_correctness import ONE_REPLICA, write_spec
from tests.e2e.test_worker_recovery import check_trained_once, slot_of, start_run

#: Long enough that the run still trains when the drain command (a process start) gets there.
ITERATIONS = 40
ROOT = Path(__file__).resolve().parents[2]


async def reported(r: Redis, run: str, iteration: int) -> None:
    """Until some worker reported `iteration` done."""
    cursor = "0"
    while True:
        reply = await r.xread({keys.events_stream(run): cursor}, block=120_000)
        assert reply, f"training never got to iteration {iteration}"
        cursor = reply[0][1][-1][0]
        if any(isinstance(m := decode(f[b"m"]), IterationDone) and m.iteration >= iteration for _, f in reply[0][1]):
            return


async def drain_and_replace(
    tmp_path: Path, url: str, overrides: dict[str, object] | None, how: str, said: Callable[[], str] | None = None
) -> tuple[list[Proc], str, list[object], Path]:
    """`how`: "command" (`bubbletea drain`, through the command's entry point in this process, `said`
    returning what it wrote to stderr) or "signal" (SIGTERM to the worker)."""
    path = write_spec(tmp_path, overrides, iterations=ITERATIONS, checkpoint_every=4)
    run, env, procs = await start_run(url, path)
    r = blocking_client(url)
    try:
        await reported(r, run, 2)
        victim = procs[1]
        slot = slot_of(victim)
        if how == "command":
            # The command's own parser and function, in this process (not its entry point, which stops
            # this process's fork server and so the workers): a new process's start (its imports)
            # took longer than the run's last 38 iterations on a busy machine, and found it finished.
            replica, stage = (int(n) for n in slot[1:].split("s"))
            assert await r.get(keys.lease_key(run, replica, stage)), "the victim holds its slot as it is drained"
            argv = ["drain", slot, "--run", run, "--config", str(path)]
            args = build_parser().parse_args(argv)
            code = await asyncio.to_thread(args.func, args)  # REDIS_URL: the test's environment
            assert said is not None
            assert code == 0, said()
            assert "left the run after iteration" in said(), said()
        else:
            victim.proc.send_signal(signal.SIGTERM)  # an orchestrator evicting its pod
        assert await asyncio.wait_for(victim.proc.wait(), 120) == 0, "\n".join(victim.tail)
        assert any("left the run; its slot goes to a spare or a replacement" in line for line in victim.tail)
        out = io.StringIO()
        procs.append(await spawn(STAGE_WORKER, env, out=out))  # what up (or the orchestrator) starts
        survivors = [p for p in procs[1:] if p is not victim]
        codes = await asyncio.wait_for(asyncio.gather(*(p.proc.wait() for p in survivors)), 240)
        assert codes == [0] * len(survivors), "\n".join(line for p in survivors for line in p.tail[-10:])
        events = [decode(f[b"m"]) for _, f in await r.xrange(keys.events_stream(run))]
        return procs, out.getvalue(), events, path
    finally:
        await r.aclose()
        await stop_all(procs)


async def test_a_drained_worker_leaves_at_a_step_boundary_and_the_run_goes_on(
    tmp_path: Path, redis_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PP=2 x DP=2, `bubbletea drain`: the replacement takes the stage's state from the live peer."""
    monkeypatch.setenv("REDIS_URL", redis_server.url)  # as a shell sets it for the command
    err: list[str] = []

    def said() -> str:
        err.append(capsys.readouterr().err)
        return "".join(err)

    _, replacement, events, path = await drain_and_replace(tmp_path, redis_server.url, None, "command", said)
    joined = [line for line in replacement.splitlines() if "joined the run" in line]
    assert joined and "source=peers" in joined[-1], replacement[-3000:]
    await check_trained_once(events, path, ITERATIONS, redis_server.url)


async def test_a_worker_of_one_replica_evicted_hands_its_state_over_through_its_own_checkpoint(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """DP = 1 (no live peer holds the stage's state), SIGTERM: the worker writes its checkpoint at the
    step boundary, and the replacement resumes from it while the other stage keeps its own."""
    _, replacement, events, path = await drain_and_replace(tmp_path, redis_server.url, ONE_REPLICA, "signal")
    joined = [line for line in replacement.splitlines() if "joined the run" in line]
    assert joined and "source=peers" in joined[-1], replacement[-3000:]
    await check_trained_once(events, path, ITERATIONS, redis_server.url)


async def test_sigterm_to_every_worker_at_once_stops_the_whole_run(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    path = write_spec(tmp_path, iterations=100, checkpoint_every=4)
    run, _, procs = await start_run(redis_server.url, path)
    r = blocking_client(redis_server.url)
    try:
        await reported(r, run, 1)
        workers = procs[1:]
        for p in workers:  # as compose down, scancel or a deleted StatefulSet sends it: to each, at once
            p.proc.send_signal(signal.SIGTERM)
        codes = await asyncio.wait_for(asyncio.gather(*(p.proc.wait() for p in workers)), 120)
        assert codes == [0] * len(workers), "\n".join(line for p in workers for line in p.tail[-10:])
        spec = load_settings(path, env={}).spec
        views = await read_slots(r, run, spec.parallelism.pp, spec.parallelism.dp)
        assert all(v.ended is LeaseState.STOPPED and not v.held for v in views), views
    finally:
        await r.aclose()
        await stop_all(procs)
