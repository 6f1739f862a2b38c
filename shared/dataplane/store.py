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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import redis
import torch.distributed as dist

#: How long a rendezvous key lives: far longer than any group takes to form.
KEY_TTL_S = 3600
#: How often a waiting `get` / `wait` looks again (a group forms once per generation: cheap enough).
POLL_S = 0.002
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
        self._redis = redis.Redis.from_url(url, protocol=2)
        self._prefix = prefix
        self._timeout = timedelta(seconds=timeout_s)
        self._called_off = called_off

    def _check_called_off(self) -> None:
        if self._called_off is not None and self._called_off.is_set():
            raise RuntimeError(f"data-plane rendezvous under {self._prefix!r}: called off (this worker is stopping)")

    def _key(self, key: str) -> str:
        return self._prefix + key

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
        self._call(lambda: self._redis.set(self._key(key), value, ex=KEY_TTL_S))

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._call(lambda: self._redis.get(self._key(key)))
        if value is None:  # expired between the wait and the read
            raise RuntimeError(f"data-plane rendezvous key {self._key(key)!r} vanished")
        return value if isinstance(value, bytes) else str(value).encode()

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)

        def incr() -> Any:
            with self._redis.pipeline() as p:
                p.incrby(k, amount)
                p.expire(k, KEY_TTL_S)
                return p.execute()[0]

        return int(self._call(incr))

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return False
        return self._call(lambda: self._redis.exists(*(self._key(k) for k in keys))) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            self._check_called_off()
            if time.monotonic() > deadline:
                missing = ", ".join(keys)
                raise RuntimeError(
                    f"data-plane rendezvous: no peer wrote {missing} under {self._prefix!r} within {limit:.0f} s"
                )
            time.sleep(POLL_S)

    def delete_key(self, key: str) -> bool:
        return bool(self._call(lambda: self._redis.delete(self._key(key))))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def num_keys(self) -> int:
        return self._call(lambda: sum(1 for _ in self._redis.scan_iter(match=self._prefix + "*")))

    def close(self) -> None:
        self._redis.close()
