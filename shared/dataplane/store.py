"""The rendezvous of the data plane: a torch.distributed `Store` kept in the run's Redis.

Why Redis and not a `TCPStore`: every process of a run already reaches the same Redis (the control
plane), it outlives any one worker (a TCPStore lives in the process that hosts it, so losing that
worker would lose the rendezvous of everyone), and its keys can expire. gloo only needs `set`, `get`
and `wait` to exchange each rank's listening address when a group forms; it calls them from its own
C++ threads, synchronously, so this store uses redis-py's blocking client on a connection of its own.

Every key gets a TTL: a group's rendezvous is needed only while it forms.

A Redis restart while a group forms (`bubbletea up --persist` restarts its Redis at once, on the
same files) is ridden out like everywhere else in the system: each call is tried again until Redis
answers, within the store's timeout, and only then fails the formation (a `PlaneError`, naming it).

A formation can be called off (`called_off`, set by a worker that stops while it waits for peers
that may never come, as its whole run stops): the waits and retries end at once with a RuntimeError,
so the thread forming the group ends with the worker rather than wait out the timeout.

Waiting does not poll. A `set` (or `add`) also pushes a token onto the key's wake list (same hash
tag, same TTL); a waiter first looks for the key, and while it is missing blocks on that list
(BLPOP, `WAKE_S` at most, then looks again and checks whether it was called off). A waiter woken
pushes the token back before it reads on, so every other waiter of the key wakes in turn. A key
set before the wait is seen by the first look; a token pushed between a look and the BLPOP stays
in the list for the BLPOP: no wake-up is lost.

On a Redis Cluster (a ``redis+cluster://`` URL) the store uses redis-py's cluster client. A key and
its wake list share one slot: under the run's hash tag when the prefix carries one (the contract of
shared/wire/keys.py: ``bt:{<run>}:plane:...``), else the wake list takes the whole key as its tag.
No command here touches two keys of different slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import redis
import torch.distributed as dist

from shared.bus.connection import CONNECT_TIMEOUT_S, sync_client_for

#: How long a rendezvous key lives: far longer than any group takes to form.
KEY_TTL_S = 3600
#: The longest one blocking wait on a key's wake list: how soon a waiter notices it was called off
#: (or a token it missed in a Redis restart). An idle waiter sends two commands a second.
WAKE_S = 0.5
#: The socket timeout of the store's connection: a blocking wait of `WAKE_S` answers well within it.
SOCKET_TIMEOUT_S = 30.0
#: What a key's wake list is named after (the key, then this).
WAKE_SUFFIX = ":wake"
#: The first and the longest pause between tries while Redis does not answer.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0

T = TypeVar("T")


class RedisStore(dist.Store):
    """`dist.Store` over Redis, every key under `prefix` (one prefix per group formation)."""

    def __init__(
        self, url: str, prefix: str, timeout_s: float = 60.0, called_off: threading.Event | None = None
    ) -> None:
        super().__init__()
        self._redis = sync_client_for(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S)
        self._prefix = prefix
        self._timeout = timedelta(seconds=timeout_s)
        self._called_off = called_off

    def _check_called_off(self) -> None:
        if self._called_off is not None and self._called_off.is_set():
            raise RuntimeError(f"data-plane rendezvous under {self._prefix!r}: called off (this worker is stopping)")

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _wake(self, key: str) -> str:
        """The wake list of `key`, in the same cluster slot (see `wake_list`)."""
        return wake_list(self._key(key))

    def _call(self, op: Callable[[], T]) -> T:
        """`op` against Redis, tried again while Redis does not answer (a restart), until the
        store's timeout; then a RuntimeError, which gloo turns into a failed formation."""
        limit = self._timeout.total_seconds()
        deadline, pause = time.monotonic() + limit, RETRY_FIRST_S
        while True:
            try:
                return op()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._check_called_off()
                if time.monotonic() + pause > deadline:
                    raise RuntimeError(
                        f"data-plane rendezvous under {self._prefix!r}: Redis did not answer for {limit:.0f} s ({exc})"
                    ) from None
                time.sleep(pause)  # a blocking client on gloo's own thread: nothing else waits on it
                pause = min(pause * 2, RETRY_MAX_S)

    def set(self, key: str, value: bytes | str) -> None:
        k, wake = self._key(key), self._wake(key)

        def write() -> None:
            with self._redis.pipeline(transaction=True) as p:
                p.set(k, value, ex=KEY_TTL_S)
                p.rpush(wake, 1)
                p.expire(wake, KEY_TTL_S)
                p.execute()

        self._call(write)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._call(lambda: self._redis.get(self._key(key)))
        if value is None:  # expired between the wait and the read
            raise RuntimeError(f"data-plane rendezvous key {self._key(key)!r} vanished")
        return value if isinstance(value, bytes) else str(value).encode()

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)

        wake = self._wake(key)

        def incr() -> Any:
            with self._redis.pipeline(transaction=True) as p:
                p.incrby(k, amount)
                p.expire(k, KEY_TTL_S)
                p.rpush(wake, 1)
                p.expire(wake, KEY_TTL_S)
                return p.execute()[0]

        return int(self._call(incr))

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return False
        # One EXISTS a key: on a cluster each goes to its own slot's node.
        return all(self._exists(k) for k in keys)

    def _exists(self, key: str) -> bool:
        return bool(self._call(lambda: self._redis.exists(self._key(key))))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        for key in keys:
            self._wait_one(key, deadline, limit, keys)

    def _wait_one(self, key: str, deadline: float, limit: float, keys: list[str]) -> None:
        """Block until `key` exists (the module's docstring: look, then BLPOP its wake list)."""
        k, wake = self._key(key), self._wake(key)
        while not self._call(lambda: self._redis.exists(k)):
            self._check_called_off()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(keys)
                raise RuntimeError(
                    f"data-plane rendezvous: no peer wrote {missing} under {self._prefix!r} within {limit:.0f} s"
                )
            if self._woken(wake, min(WAKE_S, max(left, 0.01))):
                # Pass the wake-up on to the next waiter of this key (the token stays, with its TTL).
                self._call(lambda: self._redis.rpush(wake, 1))

    def _woken(self, wake: str, block_s: float) -> bool:
        """Block on the wake list `wake` for up to `block_s`; whether a token came."""
        return self._call(lambda: self._redis.blpop([wake], timeout=block_s)) is not None

    def delete_key(self, key: str) -> bool:
        return bool(self._call(lambda: self._redis.delete(self._key(key))))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def num_keys(self) -> int:
        def count() -> int:
            found = self._redis.scan_iter(match=self._prefix + "*")
            return sum(1 for k in found if not _text(k).endswith(WAKE_SUFFIX))

        return self._call(count)

    def close(self) -> None:
        self._redis.close()


def _text(key: bytes | str) -> str:
    return key.decode(errors="replace") if isinstance(key, bytes) else key


def wake_list(key: str) -> str:
    """The wake list of rendezvous key `key`, hashing to the same cluster slot: ``<key>:wake``
    when `key` carries a hash tag (``{...}``, not empty), else ``{<key>}:wake`` (the whole key
    as the tag, which is how Redis hashes an untagged key)."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    if start >= 0 and end > start + 1:
        return key + WAKE_SUFFIX
    return "{" + key + "}" + WAKE_SUFFIX
