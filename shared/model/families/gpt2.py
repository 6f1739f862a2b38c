"""GPT-2 (Hugging Face `model_type` gpt2) as a `CausalLM`, nanoGPT's way.

Learned token and position embeddings, pre-LayerNorm blocks with fused q/k/v, a GELU MLP, a final
LayerNorm and a head tied to the token embedding (or its own `lm_head.weight` when
`tie_word_embeddings` is false). Checkpoint names are the module names with or without the
`transformer.` prefix; the Conv1D weights (`c_attn`, `c_proj`, `c_fc`) are stored (in, out) and
transposed on load into `nn.Linear`'s (out, in). The old causal-mask buffers (`attn.bias`,
`attn.masked_bias`) are ignored.

From config.json: n_layer, n_embd, n_head, n_positions, vocab_size, n_inner (None = 4 x n_embd),
activation_function, layer_norm_epsilon, scale_attn_weights, scale_attn_by_inverse_layer_idx,
tie_word_embeddings. `reorder_and_upcast_attn` changes nothing in float32. Refused:
`add_cross_attention` (an encoder-decoder variant).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.config.model_info import CheckpointError, ModelInfo, config_flag, ties_embeddings
from shared.model.causal import (
    KV,
    LoadableLM,
    activation,
    attend,
    config_float,
    extend_cache,
    refuse_flag,
)

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(masked_)?bias")


class GPT2Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)  # q, k, v of all heads at once
        self.c_proj = nn.Linear(d, d)


class GPT2MLP(nn.Module):
    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, inner)
        self.c_proj = nn.Linear(inner, d)


class GPT2Block(nn.Module):
    def __init__(self, d: int, inner: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = GPT2Attention(d)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = GPT2MLP(d, inner)


class GPT2(LoadableLM):
    lm_head: nn.Linear | None
    EMBEDDINGS = ("wte", "wpe")
    LAYERS = "h"
    FINAL = ("ln_f", "lm_head")
    TIED_EMBEDDING = "wte"

    def __init__(self, config: Mapping[str, Any], info: ModelInfo) -> None:
        super().__init__()
        refuse_flag(config, "add_cross_attention", "GPT-2 with cross-attention is an encoder-decoder part")
        self.info = info
        d, self.heads = info.d_model, info.heads
        inner = config.get("n_inner")
        if inner is None:
            inner = 4 * d
        if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1:
            raise CheckpointError(f"config.json 'n_inner' must be a positive integer or null, got {inner!r}")
        self.act = activation(config.get("activation_function", "gelu_new"), "activation_function")
        eps = config_float(config, "layer_norm_epsilon", 1e-5)
        head_dim = d // self.heads
        # Per layer, as transformers: 1/sqrt(head_dim) (or 1 without scale_attn_weights), divided
        # by the layer's number with scale_attn_by_inverse_layer_idx.
        base = head_dim**-0.5 if config_flag(config, "scale_attn_weights", True) else 1.0
        by_layer = config_flag(config, "scale_attn_by_inverse_layer_idx", False)
        self.scales = [base / (i + 1) if by_layer else base for i in range(info.layers)]
        self.tied = ties_embeddings(config)
        with torch.device("meta"):  # shapes only: the checkpoint's tensors are assigned on load
            self.wte = nn.Embedding(info.vocab, d)
            self.wpe = nn.Embedding(info.max_model_len, d)
            self.h = nn.ModuleList(GPT2Block(d, inner, eps) for _ in range(info.layers))
            self.ln_f = nn.LayerNorm(d, eps=eps)
            self.lm_head = None if self.tied else nn.Linear(d, info.vocab, bias=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], info: ModelInfo) -> Self:
        return cls(config, info)

    def rename(self, name: str) -> str | None:
        name = name.removeprefix("transformer.")
        if _MASK_BUFFER.fullmatch(name) or (self.tied and name == "lm_head.weight"):
            return None
        return name

    def checkpoint_name(self, name: str) -> str:
        return name if name == "lm_head.weight" else f"transformer.{name}"

    def transposed(self, name: str) -> bool:
        return name.endswith(_CONV1D)

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        return self.wte(ids) + self.wpe(positions)  # (1, T, C) + (T, C)

    def block(self, i: int, hidden: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        blk = self.h[i]
        assert isinstance(blk, GPT2Block)
        x = blk.ln_1(hidden)
        B, T, C = x.shape
        nh = self.heads
        q, k, v = blk.attn.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, nh, C // nh).transpose(1, 2)
        v = v.view(B, T, nh, C // nh).transpose(1, 2)
        k, v = extend_cache(past, k, v)  # (B, nh, T_total, hd)
        y = attend(q, k, v, scale=self.scales[i]).transpose(1, 2).reshape(B, T, C)
        hidden = hidden + blk.attn.c_proj(y)
        hidden = hidden + blk.mlp.c_proj(self.act(blk.mlp.c_fc(blk.ln_2(hidden))))
        return hidden, (k, v)

    def logits(self, hidden: Tensor) -> Tensor:
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.ln_f(hidden), weight)  # (..., C) -> (..., vocab)

    def head(self, hidden_last: Tensor) -> Tensor:
        return self.logits(hidden_last)[0]  # (1, C) -> (vocab,)
