"""`bubbletea up --redis-cluster`: the whole system on an embedded Redis Cluster (3 masters, 1
replica each): every service healthy, serving ready, a prompt answered, a clean stop on SIGTERM with
every node of the cluster gone; the flags it cannot be combined with refused in one line; and
`bubbletea redis --cluster`, which starts one by hand."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml

from tests.e2e.serving import ONE_REPLICA, SPEC, read_until, start_up, status, submit, wait_ready

ROOT = Path(__file__).resolve().parents[2]
GIVEN_SCALE = {"BUBBLETEA_TIME_SCALE": "1"}  # as tests/e2e/test_launcher_up.py, which says why


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_up_runs_on_an_embedded_redis_cluster(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**SPEC, **ONE_REPLICA, "http": {"host": "127.0.0.1", "port": 0}}))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | GIVEN_SCALE
    proc = await start_up("--redis-cluster", "--config", str(path), "--out", str(tmp_path / "runs"), env=env)
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        banner = r"==> Redis: (redis\+cluster://\S+) \(embedded cluster.*pids ([\d,]+)\)"
        where = await read_until(proc.stdout, banner, seen, 60)
        nodes = [int(p) for p in where.group(2).split(",")]
        assert len(nodes) == 6 and all(_alive(p) for p in nodes)
        await read_until(proc.stdout, r"Ctrl-C stops everything", seen, timeout=120)
        api = re.findall(r"API:\s+(http://\S+)", "".join(seen))[0]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await wait_ready(http, api, timeout=30)
            rid = await submit(http, api, {"prompt": "on a cluster", "ttft_objective_ms": 30_000})
            async with asyncio.timeout(30):
                while (answer := await status(http, api, rid))["status"] == "queued":  # noqa: ASYNC110
                    await asyncio.sleep(0.2)  # a client polls the native API: there is no push to wait on
        assert answer["status"] == "done" and answer["result"]["text"], answer
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            while raw := await proc.stdout.readline():
                seen.append(raw.decode())
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    out = "".join(seen)
    assert code == 0 and "==> stopped cleanly" in out, out
    assert not [p for p in nodes if _alive(p)], "every node of the cluster is stopped with up"


def test_up_refuses_redis_cluster_with_persist_or_redis_url(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**SPEC, **ONE_REPLICA}))
    base = [sys.executable, "-m", "bubbletea.cli", "up", "--redis-cluster", "--config", str(path)]
    base += ["--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    persist = subprocess.run([*base, "--persist"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert persist.returncode == 2 and "not with --redis-cluster" in persist.stderr, persist.stdout + persist.stderr
    url = subprocess.run(
        base, cwd=ROOT, env={**env, "REDIS_URL": "redis://127.0.0.1:1/0"}, capture_output=True, text=True, timeout=60
    )
    assert url.returncode == 2 and "REDIS_URL is set" in url.stderr, url.stdout + url.stderr


def test_redis_cluster_subcommand_prints_its_url_and_nodes_and_stops_every_node_on_sigterm() -> None:
    from redis.cluster import RedisCluster

    cmd = [sys.executable, "-m", "bubbletea.cli", "redis", "--cluster"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT) as proc:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("REDIS_URL=redis+cluster://127.0.0.1:"), url
        node_line = r"# node 127\.0\.0\.1:(\d+) pid=(\d+) (master|replica)$"
        nodes = [re.match(node_line, proc.stdout.readline().strip()) for _ in range(6)]
        assert all(nodes) and sorted(m.group(3) for m in nodes if m) == ["master"] * 3 + ["replica"] * 3
        client = RedisCluster.from_url(url.removeprefix("REDIS_URL=").replace("redis+cluster", "redis"))
        try:
            assert client.set("k", "v") and client.get("k") == b"v"
        finally:
            client.close()
        proc.send_signal(signal.SIGTERM)
        # Quick: its nodes take their SIGTERM (not blocked as the command's own stop signals are).
        assert proc.wait(10) == 0
    for m in nodes:
        assert m is not None and not _alive(int(m.group(2)))
