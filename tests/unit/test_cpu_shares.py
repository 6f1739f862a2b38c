"""The benchmarks' CPU table names each process by its service: a stage worker forked by the
launcher's fork server shows the server's command line until it sets its own title, and must not
be left named "python" (bench/lib/cpu_shares.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

#: A child that looks like a fork server's child at first, then takes a stage worker's title.
CHILD = """
import sys, time, setproctitle
print("ready", flush=True)
setproctitle.setproctitle(sys.executable + " -m " + sys.stdin.readline().strip())
print("titled", flush=True)
time.sleep(30)
"""


@pytest.fixture
def cpu_shares() -> Any:
    from bench.lib import cpu_shares as module

    return module


def test_a_forked_worker_is_named_by_the_title_it_takes_after_the_first_sample(cpu_shares: Any) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        sampler = cpu_shares.CpuSampler()
        sampler.sample()
        assert sampler.names[child.pid].startswith("python")  # not titled yet: the interpreter's name
        child.stdin.write("services.stage_worker\n")  # not in its command line before
        child.stdin.flush()
        assert child.stdout.readline().strip() == "titled"
        sampler.sample()
        assert sampler.names[child.pid] == "stage_worker"
    finally:
        child.kill()
        child.communicate()  # reaps it and closes its pipes


def test_the_fork_server_itself_is_named_so(cpu_shares: Any) -> None:
    code = "from multiprocessing.forkserver import main; import time; print('ready', flush=True); time.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"  # running: its own argv
        assert cpu_shares._service_name(server.pid) == "forkserver"
    finally:
        server.kill()
        server.communicate()
