"""The stage port's prefill side: finished KV caches out, preempted prefills' snapshots out and in.

* A **KV cache** (safetensors bytes, `shared.kvstore.kv_file`) stays on this worker's `KvShelf`,
  served by its `KvServer` (`prefill.kv_store: plane`, the default), or goes to Redis under the byte
  budget (`redis`). The answer's handle names where: the holder's address, or the Redis key.
* A **snapshot** (a prefill stopped at a layer boundary) is kept under `keys.prefill_snapshot_key`
  for the worker that resumes it; the dispatcher deletes it once the resumed batch is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from shared import keys, kvstore
from shared.config import DEFAULT_KV_BUDGET_MB
from shared.dataplane.kv import KvServer
from shared.model.prefill import PrefillState


@dataclass(frozen=True)
class KvStored:
    """What `PrefillPort.put_kv` did: `key` is "" when the cache was not kept (over budget);
    `holder` is the address of the worker that keeps it ("" when Redis does, or nobody)."""

    key: str
    size: int
    used: int  # bytes counted against the budget
    budget: int
    holder: str = ""


@dataclass
class PrefillPort:
    redis: Redis
    run: str
    #: `prefill.kv_ttl_s`: how long a finished KV cache is kept (0: none is).
    kv_ttl_s: int
    #: `prefill.kv_budget_mb` in bytes: past it finished prefills answer without a stored KV cache.
    kv_budget_bytes: int = DEFAULT_KV_BUDGET_MB << 20
    #: `prefill.kv_store: plane`: the caches stay in this worker, served by this (else in Redis).
    kv_server: KvServer | None = None

    @property
    def where(self) -> str:
        """Where kept caches count against the budget (for the "budget full" note)."""
        return "this worker" if self.kv_server is not None else f"the caches of the last {self.kv_ttl_s} s"

    async def put_kv(self, request_id: str, data: bytes, now: float) -> KvStored:
        if self.kv_server is not None:
            s = self.kv_server.shelf.put(request_id, data, now)
            return KvStored(s.key, s.size, s.used, s.budget, self.kv_server.holder if s.key else "")
        s = await kvstore.store_kv_within_budget(self.redis, request_id, data, self.kv_ttl_s, self.kv_budget_bytes, now)
        return KvStored(s.key, s.size, s.used, s.budget)

    async def save_snapshot(self, request_id: str, layer: int, state: PrefillState) -> None:
        key = keys.prefill_snapshot_key(self.run, request_id, layer)
        await kvstore.save_snapshot(self.redis, key, kvstore.snapshot(request_id, state))

    async def load_snapshot(self, handle: str, layers: int) -> PrefillState | None:
        snap = await kvstore.load_snapshot(self.redis, handle)
        return kvstore.restore(snap, layers) if snap is not None else None
