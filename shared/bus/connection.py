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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.runtime.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")

#: Errors after which a client reconnects and retries: the server went away or stalled.
#: OSError covers the builtin TimeoutError that `asyncio.timeout` raises.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)

#: Connect timeout: generous for a loaded 2-core box, short enough that a dead server is noticed.
CONNECT_TIMEOUT_S = 5.0

#: A blocking read is abandoned (and the connection replaced) if no reply comes this long after
#: its BLOCK time: the server must answer a BLOCK n read within n ms, so silence means trouble.
BLOCKING_SLACK_S = 5.0


#: Connections per command client; more concurrent commands queue for one (up to POOL_WAIT_S).
COMMAND_POOL_SIZE = 64
POOL_WAIT_S = 30.0


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
    """Pooled client for non-blocking commands (XADD, XACK, XAUTOCLAIM, keys)."""
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
    """
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
