"""The rendezvous of the data plane: a torch.distributed `Store` kept in the run's Redis.

Why Redis and not a `TCPStore`: every process of a run already reaches the same Redis (the control
plane), it outlives any one worker (a TCPStore lives in the process that hosts it, so losing that
worker would lose the rendezvous of everyone), and its keys can expire. gloo only needs `set`, `get`
and `wait` to exchange each rank's listening address when a group forms; it calls them from its own
C++ threads, synchronously, so this store uses redis-py's blocking client on a connection of its own.

Every key gets a TTL: a group's rendezvous is needed only while it forms.
"""

from __future__ import annotations

import time
from datetime import timedelta

import redis
import torch.distributed as dist

#: How long a rendezvous key lives: far longer than any group takes to form.
KEY_TTL_S = 3600
#: How often a waiting `get` / `wait` looks again (a group forms once per generation: cheap enough).
POLL_S = 0.002


class RedisStore(dist.Store):
    """`dist.Store` over Redis, every key under `prefix` (one prefix per group formation)."""

    def __init__(self, url: str, prefix: str, timeout_s: float = 60.0) -> None:
        super().__init__()
        self._redis = redis.Redis.from_url(url, protocol=2)
        self._prefix = prefix
        self._timeout = timedelta(seconds=timeout_s)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._redis.set(self._key(key), value, ex=KEY_TTL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._redis.get(self._key(key))
        if value is None:  # expired between the wait and the read
            raise RuntimeError(f"data-plane rendezvous key {self._key(key)!r} vanished")
        return value if isinstance(value, bytes) else str(value).encode()

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)
        with self._redis.pipeline() as p:
            p.incrby(k, amount)
            p.expire(k, KEY_TTL_S)
            value, _ = p.execute()
        return int(value)

    def check(self, keys: list[str]) -> bool:
        return bool(keys) and self._redis.exists(*(self._key(k) for k in keys)) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                missing = ", ".join(keys)
                raise RuntimeError(
                    f"data-plane rendezvous: no peer wrote {missing} under {self._prefix!r} within {limit:.0f} s"
                )
            time.sleep(POLL_S)

    def delete_key(self, key: str) -> bool:
        return bool(self._redis.delete(self._key(key)))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def num_keys(self) -> int:
        return sum(1 for _ in self._redis.scan_iter(match=self._prefix + "*"))

    def close(self) -> None:
        self._redis.close()
