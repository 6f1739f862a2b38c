"""BubbleTea's KV layout into vLLM's paged cache.

BubbleTea keeps a layer's keys and values as (kv_heads, positions, head_dim). vLLM keeps them in
fixed-size blocks addressed through a slot mapping: position p of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``. What a slot looks like inside a
block (keys and values interleaved or apart, packed for AMX or not) is the attention backend's
business, so the connector writes through the backend's own ``do_kv_cache_update`` with rows of
shape (positions, kv_heads, head_dim), exactly as a forward pass writes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from safetensors.torch import load as st_load

from bubbletea_vllm.handle import BadCache


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The slots of positions [start, end) of a request whose blocks are `block_ids`."""
    if end > len(block_ids) * block_size:
        raise BadCache(f"{end} positions do not fit in {len(block_ids)} blocks of {block_size}")
    pos = torch.arange(start, end, dtype=torch.long)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    return blocks[pos // block_size] * block_size + pos % block_size


def blocks_written(block_ids: Sequence[int], block_size: int, start: int, end: int) -> set[int]:
    """The blocks that positions [start, end) of a request whose blocks are `block_ids` live in.
    vLLM asks the connector past a block-aligned head of its own prefix cache, so `start` is on a
    block boundary and none of these is a cached block other requests share."""
    if start >= end:
        return set()
    return set(block_ids[start // block_size : (end - 1) // block_size + 1])


class CacheFile:
    """The tensors of one BubbleTea KV cache file, read once, sliced per layer."""

    def __init__(self, data: bytes) -> None:
        try:
            self.tensors = st_load(data)
        except Exception as exc:  # safetensors raises its own error types
            raise BadCache(f"the KV cache is not a readable safetensors file: {exc}") from None

    def rows(self, layer: int, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [start, end) of `layer`, each (end-start, kv_heads, head_dim)."""
        try:
            k, v = self.tensors[f"layers.{layer}.k"], self.tensors[f"layers.{layer}.v"]
        except KeyError:
            raise BadCache(f"the KV cache has no layer {layer}") from None
        if k.dim() != 3 or k.shape[1] < end:
            raise BadCache(f"layer {layer} of the KV cache holds {tuple(k.shape)}, not (heads, >= {end}, dim)")
        return (
            k[:, start:end].transpose(0, 1).to(dtype).contiguous(),
            v[:, start:end].transpose(0, 1).to(dtype).contiguous(),
        )

    def check_shape(self, layer: int, kv_heads: int, head_dim: int) -> None:
        k = self.tensors.get(f"layers.{layer}.k")
        if k is None or k.shape[0] != kv_heads or k.shape[2] != head_dim:
            got = None if k is None else tuple(k.shape)
            raise BadCache(
                f"layer {layer} of the KV cache is {got}; this model needs ({kv_heads}, T, {head_dim}): "
                "was it prefilled with the same checkpoint?"
            )
