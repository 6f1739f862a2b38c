"""An embedded Redis Cluster: private redis-server processes forming one cluster, for trying the
cluster backend (`bubbletea redis --cluster`, `bubbletea up --redis-cluster`) and for the tests.

Each node is an `EmbeddedRedis` (the same binary choice, memory limit and clean-up by PID) started
with ``cluster-enabled yes`` and its cluster config file in its own temporary directory. The
cluster is built from Python, with no ``redis-cli``: each master takes an equal range of the 16,384
slots (CLUSTER ADDSLOTSRANGE) and a config epoch of its own, every node meets the first
(CLUSTER MEET), each replica follows its master (CLUSTER REPLICATE); then every node must report
``cluster_state:ok`` and every replica ``master_link_status:up``.

`NODE_TIMEOUT_MS`: how long a master may not answer before the others mark it failed and its
replica starts an election (won about 0.5-1 s later). Redis's default, 15 s, is sized for real
networks; on loopback a live node answers its peers' pings within milliseconds, and only a blocked
event loop delays it (our Lua scripts are short; the embedded nodes never fork, as they do not
save). 3 s keeps a failover near 4 s, while leaving a loaded 2-core box's scheduling stalls (tens
to hundreds of ms) an order of magnitude short of a false failover.

Nodes keep ``cluster-require-full-coverage no``: while one master is down, the slots of the others
keep serving (only its own slots wait for the failover).

Tested by: tests/integration/test_redis_cluster.py, tests/e2e/test_up_redis_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType

import redis
from redis.crc import key_slot

from shared.runtime.logs import get_logger
from shared.runtime.redis_server import EmbeddedRedis, RedisServerError, find_redis_server, free_port

log = get_logger(__name__)

#: The cluster-node-timeout of the embedded nodes (the module's docstring says why 3 s).
NODE_TIMEOUT_MS = 3000
#: Slots of a Redis Cluster.
SLOTS = 16384
#: How long forming the cluster (every node ok, every replica linked) may take.
FORM_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Node:
    """One node as the cluster sees it now."""

    port: int
    pid: int | None
    role: str  # "master" or "replica"
    node_id: str
    master_id: str | None  # a replica's master
    slots: tuple[tuple[int, int], ...]  # a master's slot ranges
    alive: bool


class EmbeddedCluster:
    """`masters` masters with `replicas` replicas each, on free loopback ports."""

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        binary: str | None = None,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
        maxmemory: str | None = None,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"a cluster needs a master at least, and replicas >= 0 (got {masters}, {replicas})")
        self.masters, self.replicas = masters, replicas
        self.binary = binary or find_redis_server()
        self.node_timeout_ms = node_timeout_ms
        self.maxmemory = maxmemory
        self.dir = tempfile.mkdtemp(prefix="bubbletea-cluster-")
        self.servers: list[EmbeddedRedis] = []
        #: Each server's cluster bus port (not port + 10000, which may be taken or out of range).
        self.bus_ports: dict[int, int] = {}

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL naming the first master (the seed: clients learn the rest)."""
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def _server(self, index: int) -> EmbeddedRedis:
        cluster_port = free_port()
        server = EmbeddedRedis(
            binary=self.binary,
            data_dir=tempfile.mkdtemp(prefix=f"node{index}-", dir=self.dir),
            maxmemory=self.maxmemory,
            extra_args=[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--cluster-port",
                str(cluster_port),
                "--cluster-require-full-coverage",
                "no",
                # A replica may always stand in, however long it was cut off (a test kills masters).
                "--cluster-replica-validity-factor",
                "0",
                # A replica's first sync starts at once, not after Redis's default 5 s wait for others.
                "--repl-diskless-sync-delay",
                "0",
                # Stopping: a master does not wait (Redis's default: up to 10 s) for its replicas.
                "--shutdown-timeout",
                "0",
            ],
        )
        self.bus_ports[server.port] = cluster_port
        return server

    def start(self, timeout: float = FORM_TIMEOUT_S) -> EmbeddedCluster:
        try:
            count = self.masters * (1 + self.replicas)
            self.servers = [self._server(i) for i in range(count)]
            for server in self.servers:
                server.start()
            self._form(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        log.info("embedded redis cluster started", url=self.url, masters=self.masters, replicas=self.replicas)
        return self

    def _form(self, deadline: float) -> None:
        clients = [_client(s.port) for s in self.servers]
        try:
            masters, replicas = clients[: self.masters], clients[self.masters :]
            masters_n = self.masters
            per = SLOTS // self.masters
            for i, c in enumerate(masters):
                end = SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, end)
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for server in self.servers[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", server.port, self.bus_ports[server.port])
            ids = [_text(c.execute_command("CLUSTER", "MYID")) for c in clients]
            _until(deadline, "every node to know every other", lambda: all(_known(c) >= len(clients) for c in clients))
            for i, c in enumerate(replicas):
                master_id = ids[i % self.masters]
                _until(deadline, "a replica to follow its master", lambda c=c, m=master_id: _replicate(c, m))
            _until(deadline, "cluster_state:ok on every node", lambda: all(_state_ok(c) for c in clients))
            _until(deadline, "every replica's link up", lambda: all(_link_up(c) for c in replicas))
            _until(deadline, "every node to see the replicas", lambda: all(_masters(c) == masters_n for c in clients))
        finally:
            for c in clients:
                c.close()

    def nodes(self) -> list[Node]:
        """Every node as a live node sees it (roles change on a failover); a dead one is ``alive=False``."""
        alive = {s.port: s for s in self.servers if s.proc is not None and s.proc.poll() is None}
        for port in alive:
            with contextlib.suppress(redis.RedisError), _client(port) as c:
                return [_node(line, alive) for line in _text(c.execute_command("CLUSTER", "NODES")).splitlines()]
        raise RedisServerError("no node of the embedded cluster answers")

    def master_of(self, key: str) -> Node:
        """The master now serving `key`'s slot."""
        slot = key_slot(key.encode())  # computed here: the seed node may be the one killed
        for node in self.nodes():
            if node.role == "master" and node.alive and any(a <= slot <= b for a, b in node.slots):
                return node
        raise RedisServerError(f"no live master serves slot {slot} (of {key!r})")

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` (by its PID), as a crash: its replica, if any, takes over."""
        server = next(s for s in self.servers if s.port == port)
        log.info("killing a cluster node", port=port, pid=server.proc.pid if server.proc else None)
        server.kill()

    def kill_master_of(self, key: str) -> Node:
        """SIGKILL the master serving `key`; returns it (as it was)."""
        node = self.master_of(key)
        self.kill(node.port)
        return node

    def revive(self, port: int, timeout: float = FORM_TIMEOUT_S) -> Node:
        """Start the node on `port` again after `kill`: the same port, directory and cluster config
        file, with no data (the nodes never save). Its slots went to its promoted replica, which
        has a newer config epoch, so it rejoins as that node's replica and syncs from it in full;
        returns it once it is a replica with its link up."""
        server = next(s for s in self.servers if s.port == port)
        if server.proc is not None and server.proc.poll() is None:
            raise RedisServerError(f"the node on port {port} is running: kill it first")
        server.restart()
        deadline = time.monotonic() + timeout
        with _client(port) as c:
            _until(deadline, f"node {port} to rejoin as a replica", lambda: _rejoined(c))
        log.info("a killed cluster node rejoined as a replica", port=port, pid=server.proc.pid if server.proc else None)
        return next(n for n in self.nodes() if n.port == port)

    def stop(self) -> None:
        """Stop every node (by PID; idempotent) and remove the cluster's files."""
        for server in self.servers:  # all told first, then each waited for
            if server.proc is not None and server.proc.poll() is None:
                server.proc.terminate()
        for server in self.servers:
            server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def __aenter__(self) -> EmbeddedCluster:
        self.start()  # on the loop's thread, as `EmbeddedRedis` does (the children's death signal)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, protocol=2, socket_timeout=5, socket_connect_timeout=5)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _until(deadline: float, what: str, done: object) -> None:
    """Wait until `done()` (a cluster forms over gossip: there is no event to wait on)."""
    assert callable(done)
    while not done():
        if time.monotonic() > deadline:
            raise RedisServerError(f"embedded redis cluster: timed out waiting for {what}")
        time.sleep(0.05)


def _known(c: redis.Redis) -> int:
    return len(_text(c.execute_command("CLUSTER", "NODES")).splitlines())


def _masters(c: redis.Redis) -> int:
    lines = _text(c.execute_command("CLUSTER", "NODES")).splitlines()
    return sum(1 for line in lines if "master" in line.split()[2].split(","))


def _replicate(c: redis.Redis, master_id: str) -> bool:
    try:
        c.execute_command("CLUSTER", "REPLICATE", master_id)
    except redis.ResponseError:
        return False  # the master is not known as one here yet (gossip)
    return True


def _state_ok(c: redis.Redis) -> bool:
    reply = c.execute_command("CLUSTER", "INFO")
    return (reply.get("cluster_state") if isinstance(reply, dict) else _text(reply)) in ("ok",) or (
        "cluster_state:ok" in _text(reply)
    )


def _rejoined(c: redis.Redis) -> bool:
    info = c.info("replication")
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


def _link_up(c: redis.Redis) -> bool:
    return bool(c.info("replication").get("master_link_status") == "up")


def _node(line: str, alive: dict[int, EmbeddedRedis]) -> Node:
    """One line of CLUSTER NODES: ``id ip:port@cport flags master ping pong epoch link slot...``."""
    fields = line.split()
    port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
    flags = fields[2].split(",")
    slots = tuple((int(a), int(b or a)) for a, _, b in (s.partition("-") for s in fields[8:] if not s.startswith("[")))
    server = alive.get(port)
    return Node(
        port=port,
        pid=server.proc.pid if server is not None and server.proc is not None else None,
        role="master" if "master" in flags else "replica",
        node_id=fields[0],
        master_id=None if fields[3] == "-" else fields[3],
        slots=slots,
        alive=server is not None and "fail" not in flags,
    )
