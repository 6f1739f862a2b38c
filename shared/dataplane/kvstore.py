"""Prefill state as bytes: snapshots of preempted prefills, and finished KV caches (and the KV caches'
Redis store, `prefill.kv_store: redis`).

* A **snapshot** is a prefill stopped at a layer boundary (the input of its next block and the
  KV of the blocks before it). Any worker can resume it in a later bubble, bit-exactly. It stays
  on the worker that took it (`services/stage_worker/port/prefill.py`); Redis holds its handle.
* A **KV cache** is what a finished prefill hands to a decode service: the handle in the answer
  (`kv_transfer_params`) names its key, format, size and expiry; `fetch_kv` reads it back.

Snapshots are internal and travel as `TensorBlob`s (dtype + shape + raw bytes). A KV cache leaves
the system, so it is stored in a format others read: **safetensors** (`KV_FORMAT`, documented in
docs/api.md, "The KV cache"): one tensor per layer and kind, ``layers.<i>.k`` and ``layers.<i>.v``,
each float32 ``(kv_heads, prompt_tokens, head_dim)`` (position ``p`` of the prompt at index ``p``),
and the string metadata of `KV_METADATA`. Never pickle.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from redis.asyncio import Redis
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from shared.bus.replicated import replicated
from shared.dataplane.tensors import from_blob, to_blob
from shared.model.prefill import KV, PrefillState
from shared.wire import PrefillSnapshot, TensorBlob, WireError, keys

#: The `format` metadata of a stored KV cache; bumped if the layout ever changes.
KV_FORMAT = "bubbletea-kv/1"
#: The metadata keys every stored KV cache has (safetensors metadata values are strings).
KV_METADATA = (
    "format",  # KV_FORMAT
    "id",  # the request id
    "model",  # the served model's name
    "layers",  # how many layers (tensors layers.0.k ... layers.<layers-1>.v)
    "prompt_tokens",  # T: positions 0..T-1 are in the cache
    "prompt",  # the prompt's token ids, a JSON list
    "first_token",  # the token sampled after the prompt (not in the cache: decoding starts with it)
    "dtype",  # of every tensor: float32
    "layout",  # a sentence saying the shape of each tensor
)


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


@dataclass(frozen=True)
class StoredKV:
    """A KV cache read back: one (k, v) per layer, each (1, kv_heads, T, head_dim) as the model
    uses them, and the file's metadata (`KV_METADATA`)."""

    kv: list[KV]
    meta: dict[str, str]

    @property
    def prompt(self) -> list[int]:
        ids: list[int] = json.loads(self.meta["prompt"])
        return ids

    @property
    def first_token(self) -> int:
        return int(self.meta["first_token"])


def kv_file(request_id: str, model: str, prompt: Sequence[int], first_token: int, kv: list[KV]) -> bytes:
    """A finished prefill's KV cache as safetensors bytes (the layout in the module docstring)."""
    tensors = {}
    for i, (k, v) in enumerate(kv):
        # float32 whatever the model computed in (a guest on a GPU: bfloat16), as the format says
        tensors[f"layers.{i}.k"] = k[0].detach().to("cpu", torch.float32).contiguous()  # (kv_heads, T, head_dim)
        tensors[f"layers.{i}.v"] = v[0].detach().to("cpu", torch.float32).contiguous()
    meta = {
        "format": KV_FORMAT,
        "id": request_id,
        "model": model,
        "layers": str(len(kv)),
        "prompt_tokens": str(len(prompt)),
        "prompt": json.dumps(list(prompt)),
        "first_token": str(first_token),
        "dtype": "float32",
        "layout": "layers.<i>.k and layers.<i>.v: (kv_heads, prompt_tokens, head_dim), position p at index p",
    }
    return st_save(tensors, metadata=meta)


def read_kv_file(data: bytes) -> StoredKV:
    """Parse `kv_file` bytes (`WireError` if they are not a KV cache of this format)."""
    meta = safetensors_metadata(data)
    if meta.get("format") != KV_FORMAT:
        raise WireError(f"not a {KV_FORMAT} KV cache (format {meta.get('format')!r})")
    tensors = st_load(data)
    layers = int(meta["layers"])
    kv = [(tensors[f"layers.{i}.k"].unsqueeze(0), tensors[f"layers.{i}.v"].unsqueeze(0)) for i in range(layers)]
    return StoredKV(kv, meta)


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes: the format is an 8-byte little-endian header
    length, then that many bytes of JSON (`safetensors.torch.load` does not return the metadata)."""
    if len(data) < 8:
        raise WireError("not safetensors: shorter than its header length")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as exc:
        raise WireError(f"not safetensors: unreadable header ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


async def store_kv(r: Redis, run: str, request_id: str, data: bytes, ttl_s: int) -> tuple[str, int]:
    """Store KV cache bytes (`kv_file`) of `run`'s request for `ttl_s` seconds; returns (key, bytes stored)."""
    key = keys.kv_cache_key(run, request_id)
    await r.set(key, data, ex=ttl_s)
    return key, len(data)


#: The KV byte budget counts stored bytes in this many time buckets per `kv_ttl_s` (plus the
#: current one): a cache counts until the bucket after its expiry ends, so the count errs high by
#: at most one bucket (1/16 of the TTL), never low. Caches deleted early (a decoder used them) stay
#: counted until they would have expired: the budget bounds what is stored, conservatively.
KV_BUDGET_BUCKETS = 16

_STORE_WITHIN_BUDGET = """
local size = string.len(ARGV[1])
local used = 0
for i = 2, #KEYS do used = used + tonumber(redis.call('GET', KEYS[i]) or '0') end
if used + size > tonumber(ARGV[3]) then return {0, used} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('INCRBY', KEYS[#KEYS], size)
redis.call('EXPIRE', KEYS[#KEYS], ARGV[4])
return {1, used + size}
"""


def _bucket_width(ttl_s: int) -> int:
    return max(1, -(-ttl_s // KV_BUDGET_BUCKETS))  # ceil


def budget_keys(run: str, request_id: str, ttl_s: int, now: float) -> list[str]:
    """The keys `store_kv_within_budget`'s script touches: the cache's, then the counters of the
    buckets that span the last `ttl_s` (the current one last). All `run`'s: one hash tag."""
    width = _bucket_width(ttl_s)
    last = int(now) // width
    first = (int(now) - ttl_s) // width
    return [keys.kv_cache_key(run, request_id), *(keys.kv_budget_bucket_key(run, b) for b in range(first, last + 1))]


@dataclass(frozen=True)
class Stored:
    """What `store_kv_within_budget` did: `key` is "" when the cache was not stored (over budget)."""

    key: str
    size: int
    used: int  # bytes counted against the budget (after storing, if it was stored)
    budget: int


async def store_kv_within_budget(
    r: Redis, run: str, request_id: str, data: bytes, ttl_s: int, budget_bytes: int, now: float
) -> Stored:
    """Store KV cache bytes of `run`'s request for `ttl_s` seconds unless `run`'s caches stored in the
    last `ttl_s` (a counter per time bucket, `keys.kv_budget_bucket_key`) and this one exceed
    `budget_bytes`; the check and the store are one step (Lua), so concurrent workers never overshoot
    together. The cache and the counters are the run's keys: one hash tag, one slot of a cluster. On a
    cluster a replica holds the cache before this returns (`replicated`), so the answer that names it,
    written after, never outlives it in a failover (with a dispatcher per datacenter the answer is in
    its datacenter's tag, perhaps on another master, and the answer's own WAIT does not cover it)."""
    width = _bucket_width(ttl_s)
    key, *buckets = budget_keys(run, request_id, ttl_s, now)
    args: tuple[Any, ...] = (
        _STORE_WITHIN_BUDGET,
        1 + len(buckets),
        key,
        *buckets,
        data,
        ttl_s,
        budget_bytes,
        ttl_s + 2 * width,
    )
    (reply,) = await replicated(r, key, lambda pipe: pipe.eval(*args), "KV cache")
    stored, used = int(reply[0]), int(reply[1])
    return Stored(key if stored else "", len(data), used, budget_bytes)


async def fetch_kv(r: Redis, run: str, request_id: str) -> StoredKV | None:
    """The KV cache of `run`'s finished prefill, or None once it expired (or was used and deleted)."""
    raw: Any = await r.get(keys.kv_cache_key(run, request_id))
    return read_kv_file(raw) if raw is not None else None


async def delete_kv(r: Redis, run: str, request_id: str) -> bool:
    """A decode service deletes a KV cache of `run` once it used it: none is left behind."""
    return bool(await r.delete(keys.kv_cache_key(run, request_id)))
