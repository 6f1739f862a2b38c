"""The stage port's prefill side: finished KV caches out, preempted prefills' snapshots out and in.

* A **KV cache** (safetensors bytes, `shared.dataplane.kvstore.kv_file`) stays on this worker's `KvShelf`,
  served by its `KvServer` (`prefill.kv_store: plane`, the default), or goes to Redis under the byte
  budget (`redis`). The answer's handle names where: the holder's address, or the Redis key.
* A **snapshot** (a prefill stopped at a layer boundary: its next block's input and the KV of the
  blocks before) stays in this worker's memory too, on a shelf of its own served by a second
  `KvServer` ("bubbletea-kv-wire/1", on the data-plane host): Redis holds only its **handle**, the
  holder's "host:port", under `keys.prefill_snapshot_key` (the name the dispatcher gives the
  resuming batch and deletes once that batch is reported). The worker that resumes it reads the
  handle and fetches the bytes from the holder (from its own shelf when that is itself). A
  snapshot is dropped from the shelf once its handle is gone from Redis (the dispatcher deleted it,
  or it expired: `SWEEP_S`), and after `keys.PREFILL_SNAPSHOT_TTL_S` in any case. A holder that
  died took its snapshots with it: the handle is there, the state is not (`LOST`), and the resuming
  worker computes the request again from its prompt (an expired handle still fails the request
  with `state_expired`, as before).

A snapshot never crosses datacenters: the handle names the holder's DC too ("<dc> <host:port>"),
and a worker of another DC computes the request again from its prompt (`ELSEWHERE`, counted in
`elsewhere`) instead of fetching the state over the WAN that training's activations use
(`shared.policies.fill.resumes_from_saved_state` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from shared.bus.connection import TRANSIENT_ERRORS
from shared.config.spec import DEFAULT_KV_BUDGET_MB
from shared.dataplane import kvstore
from shared.dataplane.kv import KvServer, KvShelf
from shared.dataplane.kv_client import KvClient
from shared.model.prefill import PrefillState
from shared.policies.fill import resumes_from_saved_state
from shared.runtime.logs import get_logger
from shared.wire import PrefillSnapshot, WireError, decode, encode, keys

log = get_logger(__name__)

#: How often the holder drops snapshots whose handle is gone from Redis (spent or expired).
SWEEP_S = 5.0
#: A snapshot is put on the shelf just before its handle is written: younger than this, it is kept
#: whether or not its handle is there yet.
SWEEP_GRACE_S = 30.0


@dataclass(frozen=True)
class Lost:
    """A snapshot whose handle is there but whose state this worker does not use: the item is
    computed again from its prompt."""

    name: str

    def __repr__(self) -> str:
        return self.name


#: Its holder cannot give it (it stopped or died).
LOST = Lost("LOST")
#: It is held in another datacenter (`resume_layer`): not fetched over the WAN.
ELSEWHERE = Lost("ELSEWHERE")
#: What a resumed item starts from: its state, None (its handle expired), `LOST` or `ELSEWHERE`.
Saved = PrefillState | Lost | None


def encode_snapshot(request_id: str, state: PrefillState) -> bytes:
    """A preempted prefill's state as the bytes its holder serves (copies every tensor: call it
    off the event loop)."""
    return encode(kvstore.snapshot(request_id, state))


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
    #: `prefill.kv_budget_mb` in bytes: past it finished prefills answer without a stored KV cache;
    #: the snapshots held at once have a budget of the same size, of their own.
    kv_budget_bytes: int = DEFAULT_KV_BUDGET_MB << 20
    #: `prefill.kv_store: plane`: the caches stay in this worker, served by this (else in Redis).
    kv_server: KvServer | None = None
    #: The address this worker's snapshot server listens on (its data-plane host).
    host: str = "127.0.0.1"
    #: This worker's datacenter: snapshots held in another are not fetched (module docstring).
    dc: str = ""
    #: The datacenter whose dispatcher serves this worker (`pipeline_plan.dispatch_dc`; None: the
    #: run's one): the snapshot handles are written under its tag, with this worker's answers.
    dispatch_dc: str | None = None
    #: Resumed items computed again from their prompt because their snapshot is in another DC.
    elsewhere: int = 0
    #: This worker's snapshots, served to the worker that resumes each (started by `start`).
    snapshots: KvServer | None = None
    _client: KvClient = field(default_factory=KvClient)
    _put_at: dict[str, float] = field(default_factory=dict)  # snapshot key -> when put (monotonic)
    _sweeper: asyncio.Task[None] | None = None

    @property
    def where(self) -> str:
        """Where kept caches count against the budget (for the "budget full" note)."""
        return "this worker" if self.kv_server is not None else f"the caches of the last {self.kv_ttl_s} s"

    async def start(self) -> str:
        """Serve this worker's snapshots (once); their holder's address."""
        if self.snapshots is None:
            shelf = KvShelf(keys.PREFILL_SNAPSHOT_TTL_S, self.kv_budget_bytes)
            self.snapshots = KvServer(shelf, self.host)
            await self.snapshots.start()
            self._sweeper = asyncio.create_task(self._sweep(), name="snapshot-sweep")
        return self.snapshots.holder

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self._client.close()
        if self.snapshots is not None:
            await self.snapshots.close()

    # --- KV caches out ---------------------------------------------------------------------

    async def put_kv(self, request_id: str, data: bytes, now: float) -> KvStored:
        if self.kv_server is not None:
            s = self.kv_server.shelf.put(request_id, data, now)
            return KvStored(s.key, s.size, s.used, s.budget, self.kv_server.holder if s.key else "")
        s = await kvstore.store_kv_within_budget(
            self.redis, self.run, request_id, data, self.kv_ttl_s, self.kv_budget_bytes, now
        )
        return KvStored(s.key, s.size, s.used, s.budget)

    # --- snapshots out and in --------------------------------------------------------------

    async def shelve_snapshot(self, request_id: str, layer: int, data: bytes) -> tuple[str, str] | None:
        """Keep an encoded snapshot (`encode_snapshot`) on this worker's shelf; the handle to write
        for it (key, value), or None (logged) when the snapshots held already fill the budget (the
        request then fails when it would resume)."""
        holder = await self.start()
        assert self.snapshots is not None
        key = keys.prefill_snapshot_key(self.run, request_id, layer, self.dispatch_dc)
        stored = self.snapshots.shelf.put(key, data, time.time())
        if not stored.key:
            log.warning(
                "snapshot budget full: a preempted prefill's state was not kept",
                request=request_id,
                layer=layer,
                bytes=len(data),
                held_bytes=stored.used,
                budget_bytes=stored.budget,
            )
            return None
        self._put_at[key] = time.monotonic()
        return key, f"{self.dc} {holder}"

    async def save_snapshot(self, request_id: str, layer: int, state: PrefillState) -> bool:
        """`shelve_snapshot` of `state`, its handle written now (False: not kept)."""
        handle = await self.shelve_snapshot(request_id, layer, encode_snapshot(request_id, state))
        if handle is None:
            return False
        await self.redis.set(handle[0], handle[1], ex=keys.PREFILL_SNAPSHOT_TTL_S)
        return True

    async def load_snapshot(self, handle: str, layers: int) -> Saved:
        """The state under the handle `handle` (a `keys.prefill_snapshot_key`), fetched from its
        holder; None if the handle is gone (expired or spent), `LOST` if its holder cannot give it,
        `ELSEWHERE` if it is held in another datacenter."""
        raw: Any = await self.redis.get(handle)
        if raw is None:
            return None
        dc, _, holder = raw.decode().rpartition(" ")
        if not resumes_from_saved_state(dc, self.dc):
            self.elsewhere += 1
            log.debug("a resumed prefill's state is in another datacenter: computed again here", handle=handle, dc=dc)
            return ELSEWHERE
        if self.snapshots is not None and holder == self.snapshots.holder:
            data = self.snapshots.shelf.get(handle, time.time())
            why = "" if data is not None else "no longer on this worker's shelf"
        else:
            data, why = await self._client.fetch(holder, handle)
        if data is None:
            log.warning(
                "a preempted prefill's state is lost with its holder: it is computed again from its prompt",
                handle=handle,
                holder=holder,
                why=why,
            )
            return LOST
        msg = decode(data)
        if not isinstance(msg, PrefillSnapshot):
            raise WireError(f"{handle} on {holder} holds a {type(msg).__name__}, not a PrefillSnapshot")
        return kvstore.restore(msg, layers)

    async def _sweep(self) -> None:
        """Drop the snapshots whose handle is gone from Redis: spent (the dispatcher deleted it
        once the resumed batch was reported) or expired."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            old = [k for k, t in self._put_at.items() if now - t > SWEEP_GRACE_S]
            self._forget_expired()
            if not old:
                continue
            with contextlib.suppress(*TRANSIENT_ERRORS):  # Redis away: the next sweep tries again
                async with self.redis.pipeline(transaction=False) as pipe:
                    for k in old:
                        pipe.exists(k)
                    found = await pipe.execute()
                for k, there in zip(old, found, strict=True):
                    if not there and self.snapshots is not None:
                        self.snapshots.shelf.delete(k)
                        self._put_at.pop(k, None)

    def _forget_expired(self) -> None:
        """Stop tracking snapshots the shelf itself expired."""
        if self.snapshots is not None:
            held = self.snapshots.shelf.held
            for k in [k for k in self._put_at if k not in held]:
                del self._put_at[k]
