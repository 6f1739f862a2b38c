"""`bubbletea redis --form-cluster` on real redis-server processes it did not start: six running,
empty, cluster-enabled nodes on free ports (`EmbeddedCluster.start(form=False)`) become a cluster of
3 masters and 3 replicas that serves; a second run leaves it as it is; nodes it cannot form (not
cluster-enabled, begun by hand, unreachable, a count that does not divide, a formed cluster of
another shape) are refused in one line naming the node, and left untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from shared.runtime.cluster_form import SLOTS
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis, free_port


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "bubbletea.cli", "redis", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _spec(ports: list[int]) -> str:
    return ",".join(f"127.0.0.1:{p}" for p in ports)


def _info(port: int) -> dict[str, str]:
    with redis.Redis(port=port, decode_responses=True) as c:
        text = c.execute_command("CLUSTER", "INFO")
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _nodes_line(port: int) -> list[str]:
    """Each node's id, flags and config epoch as `port` sees them (what a forming would change)."""
    with redis.Redis(port=port, decode_responses=True) as c:
        lines = c.execute_command("CLUSTER", "NODES").splitlines()
    return sorted(" ".join(f[i] for i in (0, 2, 3, 6)).replace("myself,", "") for f in map(str.split, lines))


@pytest.fixture(scope="module")
def nodes() -> Iterator[EmbeddedCluster]:
    """Six cluster-enabled redis-servers, running, empty and unformed."""
    cluster = EmbeddedCluster(masters=3, replicas=1).start(form=False)
    yield cluster
    cluster.stop()


def test_the_command_forms_running_nodes_then_leaves_them_as_they_are(nodes: EmbeddedCluster) -> None:
    ports = [s.port for s in nodes.servers]
    assert all(_info(p)["cluster_state"] == "fail" and _info(p)["cluster_known_nodes"] == "1" for p in ports)

    r = _cli("--form-cluster", _spec(ports), "--replicas", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "formed a Redis Cluster of 6 nodes: 3 masters, 3 replicas" in r.stdout
    assert f"REDIS_URL=redis+cluster://127.0.0.1:{ports[0]}" in r.stdout
    assert all(_info(p)["cluster_state"] == "ok" for p in ports)
    seen = nodes.nodes()
    masters = [n for n in seen if n.role == "master"]
    replicas = [n for n in seen if n.role == "replica"]
    assert len(masters) == 3 and len(replicas) == 3
    assert sorted(m.port for m in masters) == sorted(ports[:3])  # the first ones given are the masters
    assert sorted(r.master_id for r in replicas) == sorted(m.node_id for m in masters)
    assert sum(b - a + 1 for m in masters for a, b in m.slots) == SLOTS
    client = RedisCluster(host="127.0.0.1", port=ports[0])
    try:  # it serves: keys on every master
        for i in range(30):
            client.set(f"k{i}", i)
        assert [int(client.get(f"k{i}")) for i in range(30)] == list(range(30))
        assert len({nodes.master_of(f"k{i}").port for i in range(30)}) == 3
    finally:
        client.close()

    before = _nodes_line(ports[0])
    again = _cli("--form-cluster", _spec(ports))  # --replicas 1 is the default
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already one Redis Cluster (3 masters, 3 replicas, state ok): left as it is" in again.stdout
    assert _nodes_line(ports[0]) == before  # the same nodes, roles and config epochs

    # Asked for another shape: refused, and the cluster untouched.
    other = _cli("--form-cluster", _spec(ports), "--replicas", "2")
    assert other.returncode == 1, other.stdout + other.stderr
    assert "of 3 masters serving slots and 3 replicas, not the 2 and 4 asked" in other.stderr
    assert "Traceback" not in other.stderr
    assert _nodes_line(ports[0]) == before


def test_nodes_it_cannot_form_are_refused_in_one_line() -> None:
    fresh = EmbeddedCluster(masters=1, replicas=1).start(form=False)
    plain = EmbeddedRedis().start()
    try:
        ports = [s.port for s in fresh.servers]
        r = _cli("--form-cluster", _spec([*ports, plain.port]), "--replicas", "0")
        assert r.returncode == 1 and f"127.0.0.1:{plain.port} is not cluster-enabled" in r.stderr, r.stderr

        r = _cli("--form-cluster", _spec([*ports, free_port()]), "--replicas", "2")
        assert r.returncode == 1 and "cannot reach the node 127.0.0.1:" in r.stderr, r.stderr

        r = _cli("--form-cluster", _spec(ports), "--replicas", "2")
        assert r.returncode == 1 and "give a multiple of 3 nodes" in r.stderr, r.stderr

        with redis.Redis(port=ports[1]) as c:  # a node someone began to form by hand
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 10)
        r = _cli("--form-cluster", _spec(ports))
        assert r.returncode == 1, r.stderr
        assert f"127.0.0.1:{ports[1]} is not a fresh node (1 nodes known, 11 slots assigned, 0 keys)" in r.stderr
        assert [_info(p)["cluster_slots_assigned"] for p in ports] == ["0", "11"]  # nothing was done to them

        r = _cli("--form-cluster", "127.0.0.1")
        assert r.returncode == 2 and "expected host:port, got '127.0.0.1'" in r.stderr, r.stderr
        r = _cli("--form-cluster", _spec(ports), "--port", "7000")
        assert r.returncode == 2 and "not with --port or --cluster" in r.stderr, r.stderr
        r = _cli("--replicas", "1")
        assert r.returncode == 2 and "go with --form-cluster" in r.stderr, r.stderr
    finally:
        plain.stop()
        fresh.stop()
