"""A stage worker forked from the launcher's fork server is the process `python -m` would start.

`procs.spawn` forks the services that import torch (`bubbletea/launcher/forked.py`); these pin
that a forked service gets what an exec'd one gets: its arguments and environment, a session of its
own, its niceness, its output through the launcher's pipe, its exit code, and a signal's."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from bubbletea.launcher import forked
from bubbletea.launcher.procs import spawn, stop_all
from bubbletea.launcher.services import STAGE_WORKER, WAN_BROKER

pytestmark = pytest.mark.skipif(not forked.available(), reason="no fork server on this platform")

PROBE = "tests.integration.forked_probe"


async def lines(proc: forked.ForkedProcess) -> list[str]:
    return [raw.decode().rstrip("\n") async for raw in proc.stdout]


async def test_a_forked_service_gets_its_argv_environment_session_niceness_and_exit_code() -> None:
    proc = await forked.fork(PROBE, ["3", "x"], {**os.environ, "PROBE": "seen"}, nice=5)
    out, code = await asyncio.gather(lines(proc), proc.wait())
    assert code == 3 and proc.returncode == 3
    assert out == [
        f"cmdline={sys.executable} -m {PROBE} 3 x",
        f"session=True nice={os.nice(0) + 5} probe=seen argv=['3', 'x']",
    ]


async def test_every_waiter_sees_a_killed_fork_exit_with_its_signal() -> None:
    proc = await forked.fork("services.stage_worker", [], {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"}, 0)
    assert proc.returncode is None
    proc.kill()
    codes = await asyncio.wait_for(asyncio.gather(proc.wait(), proc.wait(), lines(proc)), 30)
    assert codes[:2] == [-signal.SIGKILL, -signal.SIGKILL]
    proc.kill()  # exited: nothing to signal, and no error


async def test_shutdown_stops_a_fork_nobody_stopped_rather_than_wait_for_it() -> None:
    """A fork the launcher never stopped (a Ctrl-C while its start was in flight) holds the fork
    server open; the command's last step stops it (SIGTERM) and returns, instead of waiting for ever."""
    proc = await forked.fork(PROBE, ["hang"], dict(os.environ), nice=0)
    assert proc.returncode is None
    await asyncio.wait_for(asyncio.to_thread(forked.shutdown, 5.0), 30)
    assert await asyncio.wait_for(proc.wait(), 5) == -signal.SIGTERM
    again = await forked.fork(PROBE, ["4"], dict(os.environ), nice=0)  # a new server, started on demand
    assert await asyncio.wait_for(again.wait(), 60) == 4


def test_a_launcher_killed_with_sigkill_leaves_no_fork_running() -> None:
    """The fork server leaves when its launcher does, even killed, and its forks with it (SIGTERM):
    before, each fork held the server open, and a `kill -9` of `bubbletea up` left its stage
    workers running for ever."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.forked_launcher"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None
        fork_pid = int(launcher.stdout.readline())
        os.kill(fork_pid, 0)  # it runs
    finally:
        launcher.kill()
        launcher.communicate()  # reaps it and closes its pipe
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not _running(fork_pid):
            return
        time.sleep(0.1)
    os.kill(fork_pid, signal.SIGKILL)
    raise AssertionError(f"the fork {fork_pid} outlived its killed launcher by 30 s")


def _running(pid: int) -> bool:
    """Whether `pid` runs: exists and is not a zombie (exited, not reaped yet by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_spawn_forks_a_stage_worker_and_execs_the_rest(tmp_path: Path) -> None:
    """A worker with a spec that does not exist: forked, it refuses in one line, exit 2, as
    `python -m services.stage_worker` does; the broker (no torch) is exec'd and refuses alike."""
    env = {"BUBBLETEA_CONFIG": str(tmp_path / "missing.yaml"), "REDIS_URL": "redis://127.0.0.1:1/0"}
    sink = io.StringIO()
    worker = await spawn(STAGE_WORKER, env, out=sink)
    broker = await spawn(WAN_BROKER, env, out=sink)
    assert isinstance(worker.proc, forked.ForkedProcess)
    assert isinstance(broker.proc, asyncio.subprocess.Process)
    await asyncio.wait_for(asyncio.gather(worker.proc.wait(), broker.proc.wait()), 60)
    codes = await stop_all([broker, worker])
    assert codes == {"stage_worker": 2, "wan_broker": 2}
    for p in (worker, broker):
        assert any("configuration error" in line and "missing.yaml" in line for line in p.tail), list(p.tail)
        # nothing else said: in particular not runpy's warning that the package's __main__ was
        # imported before it ran (the fork server preloads what it imports, not it)
        assert not any("Warning" in line for line in p.tail), list(p.tail)


def test_a_launcher_run_from_its_standard_input_execs_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """multiprocessing imports the launcher's main module again in a fork: where that is a script
    that is not a file (`python - < script`), `spawn` execs every service instead."""
    main = types.ModuleType("__main__")
    main.__file__ = "<stdin>"
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert not forked.available()
    main.__file__ = forked.__file__
    assert forked.available()
