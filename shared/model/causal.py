"""The layer-by-layer interface every served model implements, and the pieces the families share.

A prefill runs a prompt one block at a time and may stop at any block boundary (a pipeline bubble
closed), so a served model is not one `forward` but three steps the caller drives:

    hidden = lm.embed(ids, positions)                  # (1, T) ids -> (1, T, C)
    for i in range(lm.info.layers):
        hidden, kv[i] = lm.block(i, hidden, positions, past=None)
    logits = lm.head(hidden[:, -1, :])                 # (1, C) -> (vocab,)

A decode step is the same with one new token (T = 1), its position, and each layer's cache as
`past`. `block` returns the layer's whole cache after the call: the past keys and values with the
new positions appended, each a contiguous (1, kv_heads, T_total, head_dim) tensor (grouped-query
attention stores its kv_heads once, not repeated per query head). Keys are cached as attention
uses them (after rotary embeddings, for the Llama family).

Every tensor is on the device and in the dtype of the weights (float32; a worker's guest on a GPU
casts them to bfloat16, `PrefillModel.place`): nothing here names a device, so a caller may
`.to(device)` the module and pass ids and positions on that device. Nothing uses the global RNG.
The families (`shared.model.families`) are nanoGPT-sized modules, one per architecture.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.config.model_info import CheckpointError, ModelInfo, config_flag

KV = tuple[Tensor, Tensor]  # (k, v) of one layer, each float32 (1, kv_heads, T, head_dim)


class CausalLM(nn.Module, ABC):
    """A decoder-only language model run layer by layer (see the module docstring).

    Subclasses set `info` and implement `embed`, `block` and `head`; they are frozen inference
    modules (the caller puts them in eval mode without gradients).
    """

    info: ModelInfo

    @abstractmethod
    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Token ids int64 (1, T) at `positions` int64 (T,) -> the first block's input float32 (1, T, C)."""
        raise NotImplementedError

    @abstractmethod
    def block(self, i: int, hidden: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        """Block `i` over the new positions: (1, T, C) -> ((1, T, C), the layer's full cache (k, v)).

        `past` is the layer's cache of the earlier positions (None for a prompt's first pass);
        attention is causal over past and new positions.
        """
        raise NotImplementedError

    @abstractmethod
    def head(self, hidden_last: Tensor) -> Tensor:
        """Final norm and language-model head of one position: float32 (1, C) -> logits (vocab,)."""
        raise NotImplementedError


def extend_cache(past: KV | None, k: Tensor, v: Tensor) -> KV:
    """A layer's cache after new positions: `past` with k, v (1, kv_heads, T, hd) appended, contiguous."""
    if past is None:
        return k.contiguous(), v.contiguous()
    pk, pv = past
    return torch.cat((pk, k), dim=2), torch.cat((pv, v), dim=2)  # (1, kvh, T_past + T, hd), contiguous


def attend(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, window: int | None = None) -> Tensor:
    """Causal attention of the last T positions over all S >= T cached ones: (1, H, T, hd).

    `q` is (1, heads, T, hd) for positions S-T..S-1; `k`, `v` are (1, kv_heads, S, hd) with heads a
    multiple of kv_heads (each kv head serves heads / kv_heads consecutive query heads, as
    transformers' `repeat_kv` does). `scale` defaults to 1/sqrt(hd). With a sliding `window`, the
    query at position p sees keys at positions p - window < j <= p (Mistral's convention).
    """
    heads, T, S = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != heads:
        groups = heads // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)  # (1, heads, S, hd)
        v = v.repeat_interleave(groups, dim=1)
    if window is not None and window < S:
        qpos = torch.arange(S - T, S, device=q.device)[:, None]  # (T, 1) absolute positions
        kpos = torch.arange(S, device=q.device)[None, :]  # (1, S)
        mask = (kpos <= qpos) & (kpos > qpos - window)  # (T, S): True = may attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if T == 1:  # one new position sees every cached one
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)  # (T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _gelu_tanh(x: Tensor) -> Tensor:
    # transformers' NewGELUActivation, written out as it is (the tanh approximation)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


#: Activation functions by their transformers name (`activation_function`, `hidden_act`).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


def activation(name: object, key: str) -> Callable[[Tensor], Tensor]:
    """The activation `name` of config key `key`; `CheckpointError` naming both if unsupported."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise CheckpointError(f"config.json '{key}' is {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class LoadableLM(CausalLM):
    """A family `shared.model.checkpoint` loads from a Hugging Face directory.

    `from_config` builds the modules from `config.json` on the meta device (no memory, no RNG),
    refusing with `CheckpointError` what the family does not implement; the loader then maps each
    stored tensor's name with `rename`, checks every expected tensor is there with its shape, and
    assigns them (`load_state_dict(assign=True)`).
    """

    #: Where a pipeline stage cuts the module (`shared.model.hf_stage`): the first stage's
    #: embedding attributes, the ModuleList of layers, the last stage's final norm and head, and
    #: the embedding a tied head reads its weight from.
    EMBEDDINGS: tuple[str, ...] = ()
    LAYERS: str = ""
    FINAL: tuple[str, ...] = ()
    TIED_EMBEDDING: str = ""
    #: Whether the head reuses the token embedding (`tie_word_embeddings`).
    tied: bool = False

    @classmethod
    @abstractmethod
    def from_config(cls, config: Mapping[str, Any], info: ModelInfo) -> LoadableLM:
        raise NotImplementedError

    @abstractmethod
    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and head of every position: float (..., C) -> logits (..., vocab); `head`
        is this for one position."""
        raise NotImplementedError

    @abstractmethod
    def rename(self, name: str) -> str | None:
        """This module's name for the checkpoint's tensor `name`; None for one known to be ignorable
        (e.g. `rotary_emb.inv_freq`). A name this module does not have is an unexpected tensor."""
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's usual name for this module's tensor `name` (for error messages)."""
        return name

    def transposed(self, name: str) -> bool:
        """Whether this module's tensor `name` is stored transposed (GPT-2's Conv1D weights)."""
        return False


def config_float(config: Mapping[str, Any], key: str, default: float) -> float:
    """A number of `config.json` (`default` if absent or null); `CheckpointError` naming the key otherwise."""
    value = config.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointError(f"config.json '{key}' must be a number, got {value!r}")
    return float(value)


def refuse_flag(config: Mapping[str, Any], key: str, why: str) -> None:
    """`CheckpointError` naming `key` if the config turns on a variant this family does not implement."""
    if config_flag(config, key, False):
        raise CheckpointError(f"config.json '{key}' is true: {why}; not supported")
