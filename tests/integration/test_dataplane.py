"""The data plane between real processes: tensors point to point (exact, any dtype and shape),
chunked over several TCP connections (as many as asked: counted with `ss`), the DP group's mean,
and a peer killed mid-transfer noticed at once instead of a hang."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PEER = str(Path(__file__).with_name("plane_peer.py"))
ROOT = str(Path(__file__).resolve().parents[2])


async def start(url: str, run: str, me: str, peer: str, rank: int, connections: int, action: str):
    return await asyncio.create_subprocess_exec(
        sys.executable,
        PEER,
        url,
        run,
        me,
        peer,
        str(rank),
        str(connections),
        action,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


async def line(proc: asyncio.subprocess.Process, timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
    assert raw, f"peer {proc.pid} exited with {await proc.wait()} before answering"
    return raw.decode().strip()


async def bye(*procs: asyncio.subprocess.Process) -> None:
    """Ask each peer to leave, then wait for all (killing one that hangs). A peer may have exited
    before its exit was noticed (`returncode` still None): writing to it then fails, and it is
    waited for like the others, so no process or pipe outlives the test."""
    for p in procs:
        if p.returncode is None and p.stdin is not None:
            try:
                p.stdin.write(b"bye\n")
                await p.stdin.drain()
            except (ConnectionResetError, BrokenPipeError):
                pass  # already gone: the wait below reaps it
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), 30)
        except TimeoutError:
            p.kill()
            await p.wait()


def connections_between(pid_a: int, pid_b: int) -> int:
    """Established TCP connections with one end in each process (from `ss -tnp`)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    ends: dict[int, set[tuple[str, str]]] = {pid_a: set(), pid_b: set()}
    for row in out.splitlines():
        cols = row.split()
        pids = {int(p) for p in re.findall(r"pid=(\d+)", row)}
        for pid in pids & ends.keys():
            ends[pid].add((cols[2], cols[3]))  # (local, peer)
    return sum(1 for local, peer in ends[pid_a] if (peer, local) in ends[pid_b])


@pytest.mark.parametrize("connections", [1, 4])
async def test_tensors_cross_exactly_point_to_point_and_chunked(redis_url: str, connections: int) -> None:
    run = f"plane{connections}"
    sender = await start(redis_url, run, "r0s0", "r0s1", 0, connections, "send")
    receiver = await start(redis_url, run, "r0s1", "r0s0", 1, connections, "recv")
    try:
        assert await line(sender) == "formed" and await line(receiver) == "formed"
        got = json.loads(await line(receiver))
        assert [g["equal"] for g in got] == [True, True, True, True]
        assert [g["dtype"] for g in got] == ["torch.float32", "torch.bfloat16", "torch.int64", "torch.float32"]
        assert got[1]["shape"] == [3, 1001]
    finally:
        await bye(sender, receiver)
    assert sender.returncode == 0 and receiver.returncode == 0


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to count connections")
@pytest.mark.parametrize("connections", [1, 3, 8])
async def test_a_pair_holds_as_many_tcp_connections_as_the_spec_asks(redis_url: str, connections: int) -> None:
    run = f"conns{connections}"
    a = await start(redis_url, run, "r0s0", "r0s1", 0, connections, "hold")
    b = await start(redis_url, run, "r0s1", "r0s0", 1, connections, "hold")
    try:
        assert await line(a) == "formed" and await line(b) == "formed"
        assert connections_between(a.pid, b.pid) == connections
    finally:
        await bye(a, b)


async def test_the_dp_group_averages_every_replicas_gradients(redis_url: str) -> None:
    procs = [await start(redis_url, "dp3", f"r{r}s0", "3", r, 1, "reduce") for r in range(3)]
    try:
        for p in procs:
            assert await line(p) == "formed"
        got = [json.loads(await line(p)) for p in procs]
        assert [g["mean"] for g in got] == [[2.0], [2.0], [2.0]]  # (1 + 2 + 3) / 3 on every replica
        assert [g["latest"] for g in got] == [2.0, 2.0, 2.0]  # when the last one arrived, everywhere
    finally:
        await bye(*procs)


async def test_a_peer_killed_mid_transfer_fails_the_receive_at_once(redis_url: str) -> None:
    waiting = await start(redis_url, "lost", "r0s0", "r0s1", 0, 2, "recv_lost")
    doomed = await start(redis_url, "lost", "r0s1", "r0s0", 1, 2, "hold")
    try:
        assert await line(waiting) == "formed" and await line(doomed) == "formed"
        await asyncio.sleep(0.5)  # the receive is posted and waiting
        doomed.send_signal(signal.SIGKILL)
        ended = json.loads(await line(waiting, timeout=30))
        assert ended["ended"] == "PlaneError", ended
        assert "receive from r0s1 failed" in ended["error"]
        assert ended["after_s"] < 0.5 + 5.0  # noticed when the socket closed, not at a timeout
    finally:
        await bye(waiting, doomed)
