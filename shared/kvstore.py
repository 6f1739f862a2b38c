"""Prefill state in Redis: snapshots of preempted prefills, and finished KV caches.

* A **snapshot** is a prefill stopped at a layer boundary (the input of its next block and the
  KV of the blocks before it). Any worker can resume it in a later bubble, bit-exactly.
* A **KV cache** is what a finished prefill hands to a decode service: the handle in the answer
  (`kv_transfer_params`) names its key, size and expiry; `fetch_kv` reads it back.

Tensors travel as `TensorBlob`s (dtype + shape + raw bytes), never pickle.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from torch import Tensor

from shared import keys
from shared.model.prefill import KV, PrefillState
from shared.tensors import from_blob, to_blob
from shared.wire import KVCache, PrefillSnapshot, TensorBlob, WireError, decode, encode


def _blobs(kv: list[KV]) -> tuple[tuple[TensorBlob, TensorBlob], ...]:
    return tuple((to_blob(k), to_blob(v)) for k, v in kv)


def _tensors(kv: tuple[tuple[TensorBlob, TensorBlob], ...]) -> list[KV]:
    return [(from_blob(k), from_blob(v)) for k, v in kv]


def snapshot(request_id: str, state: PrefillState) -> PrefillSnapshot:
    if state.hidden is None:
        raise ValueError("nothing to snapshot: the prefill has not started")
    return PrefillSnapshot(
        id=request_id,
        tokens=tuple(state.tokens),
        next_layer=state.next_layer,
        hidden=to_blob(state.hidden),
        kv=_blobs(state.kv),
    )


def restore(snap: PrefillSnapshot, layers: int) -> PrefillState:
    return PrefillState(
        tokens=list(snap.tokens),
        layers=layers,
        next_layer=snap.next_layer,
        hidden=from_blob(snap.hidden),
        kv=_tensors(snap.kv),
    )


async def save_snapshot(r: Redis, key: str, msg: PrefillSnapshot) -> None:
    await r.set(key, encode(msg), ex=keys.PREFILL_SNAPSHOT_TTL_S)


async def load_snapshot(r: Redis, key: str) -> PrefillSnapshot | None:
    """The snapshot at `key`, or None if it is gone (expired, or never written)."""
    raw: Any = await r.get(key)
    if raw is None:
        return None
    msg = decode(raw)
    if not isinstance(msg, PrefillSnapshot):
        raise WireError(f"{key} holds a {type(msg).__name__}, not a PrefillSnapshot")
    return msg


def kv_message(request_id: str, model: str, kv: list[KV]) -> KVCache:
    prompt_tokens = int(kv[0][0].shape[2]) if kv else 0
    return KVCache(id=request_id, model=model, prompt_tokens=prompt_tokens, kv=_blobs(kv))


async def store_kv(r: Redis, msg: KVCache, ttl_s: int) -> tuple[str, int]:
    """Store a KV cache for `ttl_s` seconds; returns (key, bytes stored)."""
    key, data = keys.kv_cache_key(msg.id), encode(msg)
    await r.set(key, data, ex=ttl_s)
    return key, len(data)


async def fetch_kv(r: Redis, request_id: str) -> list[tuple[Tensor, Tensor]] | None:
    """The KV cache of a finished prefill as tensors, or None once it expired."""
    raw: Any = await r.get(keys.kv_cache_key(request_id))
    if raw is None:
        return None
    msg = decode(raw)
    if not isinstance(msg, KVCache):
        raise WireError(f"KV key of {request_id} holds a {type(msg).__name__}")
    return _tensors(msg.kv)
