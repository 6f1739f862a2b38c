"""The BubbleTea handle in a request's ``kv_transfer_params``, and the cache file it points at.

BubbleTea's front door answers a prefill with ``kv_transfer_params`` (docs/api.md, "The KV
cache"); the same dictionary, passed on to vLLM with the request, is what this connector reads:

    {"remote_engine_id": "bubbletea", "store": "plane", "key": REQUEST_ID, "holder": "host:port",
     "prompt_tokens": N, "format": "safetensors:bubbletea-kv/1", "expires_at": UNIX_TIME, ...}

The cache holds positions 0..N-1 of the prompt. vLLM must compute at least the last token it is
given (it needs that token's logits), so it loads at most ``len(prompt_token_ids) - 1`` positions:
a request sent with the prompt followed by BubbleTea's first token (what the front door sends)
loads all N and vLLM computes no prompt token; a request sent with the prompt alone loads N-1 and
recomputes the last one.

The file: safetensors, tensors ``layers.<i>.k`` / ``layers.<i>.v`` float32 (kv_heads, N, head_dim),
position p at index p, metadata ``format``, ``prompt`` (a JSON list of token ids) and more. Pure:
torch and safetensors only, no vLLM.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

ENGINE_ID = "bubbletea"
FILE_FORMAT = "bubbletea-kv/1"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class BadCache(Exception):
    """The handle or the cache it names cannot serve this request (a sentence why)."""


@dataclass(frozen=True)
class Handle:
    key: str  # the prefilled request's id: the cache's name on its holder
    holder: str  # host:port of the worker keeping it
    prompt_tokens: int  # positions 0..prompt_tokens-1 are in the cache
    expires_at: float  # wall clock; 0 = unknown

    def loadable(self, prompt_len: int) -> int:
        """How many leading positions of a `prompt_len`-token request the cache can supply."""
        return max(0, min(self.prompt_tokens, prompt_len - 1))


def parse_handle(params: dict[str, Any] | None) -> Handle | None:
    """The handle in `params`, or None if they are not BubbleTea's. `BadCache` if they are ours but
    hold no usable cache (none was kept, or it is in a store this connector does not read)."""
    if not params or params.get("remote_engine_id") != ENGINE_ID:
        return None
    store = params.get("store")
    if store != "plane":
        why = params.get("why") or f"its store is {store!r}; the connector reads only 'plane'"
        raise BadCache(f"the BubbleTea handle of {params.get('key')} has no cache to load: {why}")
    try:
        return Handle(
            key=str(params["key"]),
            holder=str(params["holder"]),
            prompt_tokens=int(params["prompt_tokens"]),
            expires_at=float(params.get("expires_at") or 0.0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadCache(f"the BubbleTea handle is malformed ({exc!r}): {params}") from None


def metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (an 8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise BadCache("the KV cache is not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as exc:
        raise BadCache(f"the KV cache's safetensors header is unreadable: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def check(meta: dict[str, str], handle: Handle, prompt: list[int], end: int) -> None:
    """Refuse a cache that is not ours, or was computed for another prompt than positions [0, end)
    of `prompt`."""
    if meta.get("format") != FILE_FORMAT:
        raise BadCache(f"the KV cache of {handle.key} has format {meta.get('format')!r}, not {FILE_FORMAT}")
    try:
        cached = json.loads(meta["prompt"])
    except (KeyError, ValueError):
        raise BadCache(f"the KV cache of {handle.key} does not say its prompt") from None
    if len(cached) < end or list(cached[:end]) != list(prompt[:end]):
        raise BadCache(f"the KV cache of {handle.key} was computed for another prompt than this request's")


def layer_index(layer_name: str) -> int:
    """The decoder layer of a vLLM attention layer name, e.g. model.layers.3.self_attn.attn -> 3."""
    m = _LAYER.search(layer_name)
    if m is None:
        raise BadCache(f"cannot tell which layer {layer_name!r} is")
    return int(m.group(1))
