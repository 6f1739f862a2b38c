"""Redis clients for the bus, with every timeout and protocol choice made explicitly.

redis-py 8 changed defaults (a 5 s socket timeout, RESP3 replies). We pin both here so the bus
behaves the same across redis-py versions:

* RESP2 replies, so stream replies keep their documented list shapes;
* command clients: a pool, a short socket timeout, and redis-py's retry with jittered backoff on
  connection errors, so a publish survives a Redis restart;
* blocking clients: one dedicated connection per consumer (a blocking XREADGROUP would otherwise
  hold a pooled connection hostage), with a socket timeout comfortably longer than the block time,
  so the read returns on its own before the socket gives up.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

#: Errors after which a client reconnects and retries: the server went away or stalled.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)

#: Command timeout: generous for a loaded 2-core box, short enough that a dead server is noticed.
COMMAND_TIMEOUT_S = 5.0

#: Slack between a blocking read's BLOCK time and its socket timeout.
BLOCKING_SLACK_S = 5.0


def backoff() -> ExponentialWithJitterBackoff:
    """Reconnect backoff: starts at 20 ms, doubles, capped at 2 s, jittered so peers don't stampede."""
    return ExponentialWithJitterBackoff(cap=2.0, base=0.02)


def command_client(url: str, *, name: str = "bubbletea") -> Redis:
    """Pooled client for non-blocking commands (XADD, XACK, XAUTOCLAIM, keys)."""
    return Redis.from_url(
        url,
        protocol=2,
        socket_timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=COMMAND_TIMEOUT_S,
        retry=Retry(backoff(), retries=8),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        client_name=name,
    )


def blocking_client(url: str, *, block_ms: int, name: str = "bubbletea-reader") -> Redis:
    """A client with a private pool, used only by one consumer's read loop (so one connection).

    Not ``single_connection_client``: on cancellation that mode reconnects inside a ``finally``,
    which can hang a shutdown; a private pool simply drops the interrupted connection.
    """
    return Redis.from_url(
        url,
        protocol=2,
        max_connections=2,
        socket_timeout=block_ms / 1000 + BLOCKING_SLACK_S,
        socket_connect_timeout=COMMAND_TIMEOUT_S,
        # The consumer loop owns reconnects (it must re-sync its pending entries afterwards).
        retry=Retry(backoff(), retries=0),
        client_name=name,
    )
