"""KV caches on the data plane: a finished prefill's KV cache stays in the memory of the worker that
computed it, and a decode service fetches it over torch.distributed; Redis carries only the handle
(`PrefillResult.kv_holder`, `kv_key`) and the small fetch and delete requests
(`prefill.kv_store: plane`, the default; `redis` keeps the old store, `shared.kvstore`).

The holder (a stage worker) keeps each cache as its safetensors bytes (`shared.kvstore.kv_file`) on
a `KvShelf`: `prefill.kv_ttl_s` after the answer it expires, and the caches held at once stay
within `prefill.kv_budget_mb` of the worker's memory (past it a prefill answers without one, and
the handle says why). Its `KvServer` reads `KvFetch` and `KvDelete` on its own stream
(`keys.kv_holder_stream`).

One fetch (`fetch`), fresh for each: the decode service publishes `KvFetch(id, rendezvous)` and
both sides form a two-rank gloo group under that key prefix (the holder rank 0, listening on its
data-plane address; the fetcher rank 1, connecting to it). On it the holder sends a header, int64
(found, bytes), then the bytes if found; the fetcher answers with one byte once they are in, and
only then does the holder drop the group (closing a socket with data still unread on it could
reset the connection under the last bytes). A group per fetch costs one TCP connection and a
rendezvous through Redis (`bench/transport.py` reports `kv_fetch_ms_p50`), small next to the
tokens a decode then generates, and leaves nothing to repair when either side dies. A holder that
is gone took its caches with it: its end never forms, and the fetch fails after
`KV_FETCH_TIMEOUT_S` saying so; a fetcher that is gone leaves the holder's end to time out the
same way, in a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from shared import keys
from shared.bus import Bus, Consumer, Delivery
from shared.dataplane.plane import PlaneError, form_group, in_thread
from shared.kvstore import Stored
from shared.logs import get_logger
from shared.wire import KvDelete, KvFetch

log = get_logger(__name__)

#: How long either end of a fetch waits for the other (rendezvous and transfer each).
KV_FETCH_TIMEOUT_S = 10.0
#: How often a holder drops its expired caches and refreshes its stream's expiry.
SWEEP_S = 5.0

_HEADER, _DATA, _ACK = 1, 2, 3


@dataclass
class _Held:
    data: torch.Tensor  # uint8, the safetensors bytes
    expires: float  # wall clock


@dataclass
class KvShelf:
    """The KV caches one worker holds (pure: the caller passes `now`)."""

    ttl_s: int
    budget_bytes: int
    held: dict[str, _Held] = field(default_factory=dict)
    used: int = 0

    def put(self, request_id: str, data: bytes, now: float) -> Stored:
        """Hold `data` for `ttl_s` unless it would take the caches held past `budget_bytes`
        (then `key` is "", as `shared.kvstore.store_kv_within_budget` says it)."""
        self.expire(now)
        self.delete(request_id)  # a request answered twice (redelivered) holds one cache
        if self.used + len(data) > self.budget_bytes:
            return Stored("", len(data), self.used, self.budget_bytes)
        self.held[request_id] = _Held(torch.frombuffer(bytearray(data), dtype=torch.uint8), now + self.ttl_s)
        self.used += len(data)
        return Stored(request_id, len(data), self.used, self.budget_bytes)

    def get(self, request_id: str, now: float) -> torch.Tensor | None:
        held = self.held.get(request_id)
        if held is None or held.expires <= now:
            return None
        return held.data

    def delete(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.used -= held.data.numel()
        return held is not None

    def expire(self, now: float) -> int:
        gone = [rid for rid, h in self.held.items() if h.expires <= now]
        for rid in gone:
            self.delete(rid)
        return len(gone)


def _serve_one(redis_url: str, rendezvous: str, address: str, data: torch.Tensor | None, timeout: timedelta) -> None:
    """The holder's end of one fetch (blocking; in a thread)."""
    group = form_group(redis_url, rendezvous, 0, 2, address, timeout)
    header = torch.tensor([0 if data is None else 1, 0 if data is None else data.numel()], dtype=torch.int64)
    try:
        works = [group.send([header], 1, _HEADER)]
        if data is not None:
            works.append(group.send([data], 1, _DATA))
        ack = torch.zeros(1, dtype=torch.uint8)
        works.append(group.recv([ack], 1, _ACK))
        for w in works:
            w.wait()
    except RuntimeError as exc:
        raise PlaneError(f"KV fetch under {rendezvous}: {str(exc).splitlines()[0]}") from None


def _receive_one(redis_url: str, rendezvous: str, address: str, timeout: timedelta) -> bytes | None:
    """The fetcher's end of one fetch (blocking; in a thread): the bytes, or None if not held."""
    group = form_group(redis_url, rendezvous, 1, 2, address, timeout)
    try:
        header = torch.zeros(2, dtype=torch.int64)
        group.recv([header], 0, _HEADER).wait()
        found, size = (int(x) for x in header.tolist())
        out = None
        if found:
            buf = torch.empty(size, dtype=torch.uint8)
            group.recv([buf], 0, _DATA).wait()
            out = buf.numpy().tobytes()
        group.send([torch.ones(1, dtype=torch.uint8)], 0, _ACK).wait()
        return out
    except RuntimeError as exc:
        raise PlaneError(f"KV fetch under {rendezvous}: {str(exc).splitlines()[0]}") from None


class KvServer:
    """A worker's KV caches, served to decode services on the data plane (module docstring)."""

    def __init__(
        self, bus: Bus, redis_url: str, holder: str, address: str, shelf: KvShelf, timeout_s: float = KV_FETCH_TIMEOUT_S
    ) -> None:
        self.bus, self.redis_url, self.holder, self.address, self.shelf = bus, redis_url, holder, address, shelf
        self.timeout = timedelta(seconds=timeout_s)
        self.served = 0
        self._consumer: Consumer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        stream = keys.kv_holder_stream(self.holder)
        self._consumer = self.bus.consumer(
            stream, "holder", {KvFetch: self.on_fetch, KvDelete: self.on_delete}, name=self.holder
        )
        await self._consumer.start()
        self._sweeper = asyncio.create_task(self._sweep(stream), name="kv-sweep")
        log.info("KV caches held on the data plane", holder=self.holder, address=self.address)

    async def on_fetch(self, d: Delivery) -> None:
        m = d.message
        assert isinstance(m, KvFetch)
        data = self.shelf.get(m.id, time.time())
        try:
            await in_thread(_serve_one, self.redis_url, m.rendezvous, self.address, data, self.timeout)
        except PlaneError as exc:  # the fetcher died or never came: it fails on its side too
            log.warning("KV fetch failed", id=m.id, fetcher=m.fetcher, error=str(exc))
            return
        self.served += 1
        log.debug("KV cache served", id=m.id, fetcher=m.fetcher, found=data is not None)

    async def on_delete(self, d: Delivery) -> None:
        m = d.message
        assert isinstance(m, KvDelete)
        self.shelf.delete(m.id)

    async def _sweep(self, stream: str) -> None:
        while True:
            self.shelf.expire(time.time())
            with contextlib.suppress(Exception):  # housekeeping: retried at the next sweep
                await self.bus.redis.expire(stream, keys.KV_HOLDER_TTL_S)
            await asyncio.sleep(SWEEP_S)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()


async def fetch(
    bus: Bus, redis_url: str, holder: str, request_id: str, address: str, fetcher: str,
    timeout_s: float = KV_FETCH_TIMEOUT_S,
) -> tuple[bytes | None, str]:  # fmt: skip
    """The KV cache bytes of `request_id` from `holder`, or None and why not."""
    rendezvous = keys.kv_rendezvous(holder, uuid.uuid4().hex)
    await bus.publish(
        keys.kv_holder_stream(holder),
        KvFetch(id=request_id, rendezvous=rendezvous, fetcher=fetcher),
        maxlen=keys.KV_HOLDER_MAXLEN,
    )
    try:
        data = await in_thread(_receive_one, redis_url, rendezvous, address, timedelta(seconds=timeout_s))
    except PlaneError as exc:
        return None, f"the worker holding the KV cache of {request_id} ({holder}) did not answer: {exc}"
    if data is None:
        return None, f"no KV cache for {request_id} on {holder}: it expired (prefill.kv_ttl_s) or was freed"
    return data, ""


async def delete(bus: Bus, holder: str, request_id: str) -> None:
    await bus.publish(keys.kv_holder_stream(holder), KvDelete(id=request_id), maxlen=keys.KV_HOLDER_MAXLEN)
