"""Redis clients for the bus, with every timeout and protocol choice made explicitly.

redis-py 8 changed defaults (a 5 s socket timeout, RESP3 replies). We pin them here so the bus
behaves the same across redis-py versions:

* RESP2 replies, so stream replies keep their documented list shapes;
* **no socket timeout**. With one set, redis-py wraps every socket write in ``asyncio.wait_for``,
  and on Python 3.11 ``wait_for`` swallows a cancellation that lands in the same loop turn as the
  write completing (fixed in 3.12): a cancelled consumer or heartbeat would then run on forever.
  A crashed or restarted Redis still fails fast (the kernel resets the connection); TCP keepalive
  catches silent peers; where we need a deadline we apply ``asyncio.timeout``, which is
  cancellation-safe, around the call (see `BLOCKING_SLACK_S`);
* command clients: a *blocking* pool of `COMMAND_POOL_SIZE` connections (a burst of requests
  waits its turn for a connection instead of failing with "Too many connections");
* blocking clients: one dedicated connection per consumer (a blocking XREADGROUP would otherwise
  hold a pooled connection hostage);
* **no retries inside redis-py** (`no_retry`): every retry is ours, in one layer that logs an
  outage once, gives up at a stated deadline and stops at once when its process is stopping
  (`ride_out`, the consumer's read loop). A pooled connection that Redis closed is replaced when
  it is taken from the pool, before any command is sent on it, so a restart costs no retry.

Why no redis-py retry: up to redis-py 8.1 a synchronous ``redis.retry.Retry`` handed to an asyncio
client never retried (its loop returned the coroutine before awaiting it, so the error escaped
the loop): the jittered eight retries once written here never ran, and every Redis restart the
benches measured was ridden out by our layer alone. redis-py 8.2 converts such a retry into an
asyncio one and runs it, with a warning; running it would add a second, stop-unaware layer of up
to 6.5 s a call under ours. So the clients get an asyncio ``Retry`` with no retries, the
behaviour that was measured (docs/dependencies.md).

**Redis Cluster.** A URL ``redis+cluster://host:port`` (``rediss+cluster://`` for TLS) names any
one node of a cluster, the seed: both factories then return redis-py's asyncio `RedisCluster`,
which learns the slot map from the seed and routes each command to the master of its key's slot.
Every choice above holds for it (RESP2, no socket timeout, keepalive, ``no_retry``):

* its own retry loop gets ``no_retry`` too, so a failed command raises at once. Before raising, a
  connection error marks the topology stale: the next command (our `ride_out` retry, or the
  consumer's next read) first re-reads the slot map from the nodes it still reaches, so once a
  replica has been promoted (the cluster's ``cluster-node-timeout`` plus an election) our next
  retry lands on it. A MOVED reply is followed inside redis-py (it re-points that slot and sends
  again: not a retry, the command never ran). ``CLUSTERDOWN`` and ``TRYAGAIN`` replies, which a
  cluster gives while a failover is under way, are in `TRANSIENT_ERRORS`, ridden out like a restart;
* it has no blocking pool: each node has up to `CLUSTER_NODE_CONNECTIONS` connections and one
  more is refused with ``MaxConnectionsError`` (a ``ConnectionError``, so `ride_out` waits and
  retries it) instead of queueing for `POOL_WAIT_S`;
* commands a node answers about itself (CLIENT LIST, INFO, SCAN) are sent to a chosen node:
  `node_of` names the node holding a key (shared/bus/unblock.py, shared/control/leases.py,
  shared/control/health.py).

`command_client` and `blocking_client` are typed as returning `Redis`: `RedisCluster` offers the
same command methods, and call sites keep their ``Redis`` annotations until they move to `Client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import ClusterDownError, RedisClusterUnreachableError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.runtime.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")

#: Errors after which a client reconnects and retries: the server went away or stalled.
#: OSError covers the builtin TimeoutError that `asyncio.timeout` raises. The cluster ones come
#: during a failover: CLUSTERDOWN / TRYAGAIN replies, a slot no known master serves yet, or no
#: node of the slot map reachable for a moment.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
    RedisClusterUnreachableError,
)

#: Either client: a plain Redis, or a Redis Cluster (``redis+cluster://`` URLs).
Client = Redis | RedisCluster

#: The URL schemes that select a Redis Cluster, and the plain scheme each stands for.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

#: Connect timeout: generous for a loaded 2-core box, short enough that a dead server is noticed.
CONNECT_TIMEOUT_S = 5.0

#: A blocking read is abandoned (and the connection replaced) if no reply comes this long after
#: its BLOCK time: the server must answer a BLOCK n read within n ms, so silence means trouble.
BLOCKING_SLACK_S = 5.0


#: Connections per command client; more concurrent commands queue for one (up to POOL_WAIT_S).
COMMAND_POOL_SIZE = 64
POOL_WAIT_S = 30.0
#: Connections per node of a cluster's command client. No blocking pool exists for a cluster, so
#: this is larger than `COMMAND_POOL_SIZE` (a burst past it is refused and retried by `ride_out`).
CLUSTER_NODE_CONNECTIONS = 4 * COMMAND_POOL_SIZE


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def plain_url(url: str) -> str:
    """A cluster URL as the plain one redis-py parses (``redis+cluster://`` -> ``redis://``);
    a plain URL unchanged. A cluster has one database: a path other than ``/`` or ``/0`` is an error."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in CLUSTER_SCHEMES:
        return url
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has only database 0; {parts.path!r} in the URL is not supported")
    if not parts.hostname or not parts.port:
        raise ValueError(f"{scheme}:// needs host:port of one node of the cluster (got {url!r})")
    return urlunsplit((CLUSTER_SCHEMES[scheme], parts.netloc, "", parts.query, ""))


def is_cluster(client: object) -> bool:
    """Whether `client` (asyncio or sync) talks to a Redis Cluster."""
    from redis.cluster import RedisCluster as SyncRedisCluster

    return isinstance(client, RedisCluster | SyncRedisCluster)


def node_of(client: Client, key: str | bytes) -> ClusterNode | None:
    """The cluster node holding `key` (the master of its slot), to send a node-local command to
    (``target_nodes=``); None for a plain Redis (every command goes to the one server)."""
    if not isinstance(client, RedisCluster):
        return None
    return client.get_node_from_key(key.decode() if isinstance(key, bytes) else key)


def _cluster_client(url: str, *, max_connections: int, **options: Any) -> RedisCluster:
    return RedisCluster.from_url(
        plain_url(url),
        max_connections=max_connections,
        retry=no_retry(),
        protocol=2,
        socket_timeout=None,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        **options,
    )


def no_retry() -> Retry:
    """The retry every asyncio client of ours is given: none (the module's docstring says why).
    An asyncio ``Retry``, never ``redis.retry.Retry``, which redis-py 8.2 converts with a warning."""
    return Retry(NoBackoff(), retries=0)


def backoff() -> ExponentialWithJitterBackoff:
    """Reconnect backoff: starts at 20 ms, doubles, capped at 2 s, jittered so peers don't stampede."""
    return ExponentialWithJitterBackoff(cap=2.0, base=0.02)


#: How long a service's own Redis calls (a publish, a lease renewal) keep retrying through an
#: outage before giving up: a Redis restart, even a slow one, is ridden out; a Redis that stays
#: away longer than this is a failure to report. Loops that can wait (heartbeats, reports) never
#: give up; they log and try again next round.
RIDE_OUT_S = 30.0


class Outage:
    """Logs a Redis outage once: one warning when calls start failing, one info when one succeeds
    again (with how long it lasted), however many calls failed in between."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.failures = 0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException) -> float:
        """Count a failure; returns how long to back off before the next try."""
        if self.since is None:
            self.since = time.monotonic()
            log.warning("redis unreachable; retrying with backoff", what=self.what, error=repr(exc))
        self.failures += 1
        return backoff().compute(self.failures)

    def elapsed(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def ok(self) -> bool:
        """A call succeeded; True if that ended an outage (logged once)."""
        if self.since is None:
            return False
        log.info("redis reachable again", what=self.what, outage_s=round(self.elapsed(), 2), failures=self.failures)
        self.since, self.failures = None, 0
        return True


async def sleep_unless(event: asyncio.Event | None, seconds: float) -> None:
    """Sleep `seconds`, or less if `event` is set meanwhile (None: the whole time)."""
    if event is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


async def ride_out(
    op: Callable[[], Awaitable[T]], what: str, *, give_up_s: float = RIDE_OUT_S, unless: asyncio.Event | None = None
) -> T:
    """Run `op`, retrying transient Redis errors with `backoff` for up to `give_up_s` (then the
    last error is raised). A retried write may be applied twice (its reply was lost): callers
    rely on at-least-once semantics, as the bus does. Once `unless` is set (a process stopping),
    the next failure, or the backoff it is in, raises at once: a stopping service whose Redis died
    with its launcher (a `kill -9` of `bubbletea up`) does not wait the outage out first."""
    outage = Outage(what)
    while True:
        try:
            result = await op()
        except TRANSIENT_ERRORS as exc:
            delay = outage.failed(exc)
            stopping = unless is not None and unless.is_set()
            if stopping or outage.elapsed() + delay > give_up_s:
                log.error(
                    "redis still unreachable; giving up",
                    what=what,
                    outage_s=round(outage.elapsed(), 2),
                    why="stopping" if stopping else "outage too long",
                )
                raise
            await sleep_unless(unless, delay)
            continue
        outage.ok()
        return result


class Connected(Protocol):
    """What a consumer takes from the `Bus` that made it: the server's URL (its read loop opens its
    own blocking connection) and the bus's pooled command client (acks, claims, trims). Defined here,
    beside the clients, so that `shared.bus.consumer` need not import `shared.bus.bus`, which makes
    consumers."""

    @property
    def url(self) -> str: ...

    @property
    def redis(self) -> Redis: ...


def command_client(url: str, *, name: str = "bubbletea") -> Redis:
    """Pooled client for non-blocking commands (XADD, XACK, XAUTOCLAIM, keys); a `RedisCluster`
    for a cluster URL (the module's docstring)."""
    if is_cluster_url(url):
        client = _cluster_client(
            url, max_connections=CLUSTER_NODE_CONNECTIONS, health_check_interval=30, client_name=name
        )
        return cast(Redis, client)
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=COMMAND_POOL_SIZE,
        timeout=POOL_WAIT_S,
        protocol=2,
        socket_timeout=None,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        retry=no_retry(),
        health_check_interval=30,
        client_name=name,
    )
    return Redis.from_pool(pool)


def blocking_client(url: str, *, name: str = "bubbletea-reader") -> Redis:
    """A client with a private pool, used only by one consumer's read loop (so one connection).

    Not ``single_connection_client``: on cancellation that mode reconnects inside a ``finally``,
    which can hang a shutdown; a private pool simply drops the interrupted connection.
    A cluster URL gives a `RedisCluster` with two connections per node: the read goes to its
    stream's master.
    """
    if is_cluster_url(url):
        return cast(Redis, _cluster_client(url, max_connections=2, client_name=name))
    return Redis.from_url(
        url,
        protocol=2,
        max_connections=2,
        socket_timeout=None,  # the consumer bounds each read with asyncio.timeout instead
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        # The consumer loop owns reconnects (it must re-sync its pending entries afterwards).
        retry=no_retry(),
        client_name=name,
    )


def client_for(url: str, **options: Any) -> Redis:
    """An asyncio client with the caller's own `options` (a CLI's socket timeout, a probe's short
    connect): a `RedisCluster` for a cluster URL (with ``no_retry``, RESP2 unless `options` say
    otherwise), else a plain `Redis`. Services use `command_client` / `blocking_client`."""
    options.setdefault("protocol", 2)
    if is_cluster_url(url):
        options.setdefault("retry", no_retry())
        return cast(Redis, RedisCluster.from_url(plain_url(url), **options))
    return Redis.from_url(url, **options)


def sync_client_for(url: str, **options: Any) -> Any:
    """A synchronous client (``redis.Redis``, or ``redis.cluster.RedisCluster`` for a cluster URL),
    for the code that runs outside an event loop (the data plane's rendezvous, the launcher)."""
    import redis
    from redis.cluster import RedisCluster as SyncRedisCluster

    options.setdefault("protocol", 2)
    if is_cluster_url(url):
        return SyncRedisCluster.from_url(plain_url(url), **options)
    return redis.Redis.from_url(url, **options)
