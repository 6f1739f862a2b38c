"""The Llama family (Hugging Face `model_type` llama, mistral, qwen2) as a `CausalLM`, nanoGPT's way.

RMSNorm before attention and MLP, rotary position embeddings (rotate-half, as transformers), grouped-
query attention (the cache keeps `num_key_value_heads` heads), a SwiGLU MLP
(down(act(gate(x)) * up(x))), a final RMSNorm and a head tied to the embedding or not
(`tie_word_embeddings`). Checkpoint names are the module names under `model.` (`lm_head.weight`
beside it); `rotary_emb.inv_freq` buffers some old checkpoints carry are ignored.

From config.json: num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
head_dim, intermediate_size, vocab_size, max_position_embeddings, rms_norm_eps, hidden_act,
tie_word_embeddings; rotary from `rope_parameters` (transformers 5) or `rope_theta` +
`rope_scaling` (transformers 4): rope types default, linear and llama3 (Llama 3.1); others
(dynamic, yarn, longrope, ...) and `partial_rotary_factor` < 1 are refused naming the key.

Per model type:

* llama: `attention_bias` (biases on q, k, v and o) and `mlp_bias` are implemented.
* qwen2: q, k and v have biases, o does not. Sliding-window layers (`use_sliding_window`, with
  `layer_types` or `max_window_layers` choosing which) are implemented.
* mistral: no biases. `sliding_window` (when not null, on every layer) is implemented: the query
  at position p attends to keys p - window < j <= p, as transformers masks it. The KV cache keeps
  every position (not a rolling buffer), so `kv_bytes` holds for any prompt length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.config.model_info import CheckpointError, ModelInfo, config_flag, config_int, ties_embeddings
from shared.model.causal import (
    KV,
    LoadableLM,
    activation,
    attend,
    config_float,
    extend_cache,
    refuse_flag,
)

ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=o_bias)


class MLP(nn.Module):
    def __init__(self, d: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=bias)
        self.up_proj = nn.Linear(d, inner, bias=bias)
        self.down_proj = nn.Linear(inner, d, bias=bias)


class Layer(nn.Module):
    def __init__(self, info: ModelInfo, inner: int, eps: float, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(info.d_model, eps)
        self.self_attn = Attention(info.d_model, info.heads, info.kv_heads, info.head_dim, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(info.d_model, eps)
        self.mlp = MLP(info.d_model, inner, mlp_bias)


def rope_inv_freq(config: Mapping[str, Any], head_dim: int) -> Tensor:
    """The rotary inverse frequencies (head_dim / 2,) float32, computed as transformers does."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = config.get(key) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json '{key}' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"config.json '{key}' has rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"config.json '{key}' is nested per layer type; not supported")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"config.json 'partial_rotary_factor' is {partial!r}; only 1 (full rotary) is supported")
    theta = config_float({**config, **params}, "rope_theta", DEFAULT_ROPE_THETA)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (head_dim / 2,)
    if rope_type == "default":
        return inv_freq
    factor = config_float(params, "factor", math.nan)
    if not factor > 0:
        raise CheckpointError(f"config.json '{key}' of rope_type {rope_type} needs a positive 'factor'")
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: long wavelengths divided by factor, short ones kept, a smooth ramp between
    low = config_float(params, "low_freq_factor", math.nan)
    high = config_float(params, "high_freq_factor", math.nan)
    old_len = config_float(params, "original_max_position_embeddings", config_int(config, "max_position_embeddings"))
    if not (low > 0 and high > low):
        raise CheckpointError(f"config.json '{key}' of rope_type llama3 needs low_freq_factor < high_freq_factor")
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def sliding_windows(config: Mapping[str, Any], layers: int) -> list[int | None]:
    """Each layer's sliding attention window (None = full causal attention), as transformers reads it."""
    model_type = config["model_type"]
    if model_type == "mistral":  # one window for every layer, or none
        window = config.get("sliding_window")
        return [None if window is None else config_int(config, "sliding_window")] * layers
    if model_type == "qwen2":
        if not config_flag(config, "use_sliding_window", False):
            return [None] * layers
        window = config_int(config, "sliding_window")
        types = config.get("layer_types")
        if types is None:
            first = config_int(config, "max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise CheckpointError(f"config.json 'layer_types' must list {layers} layer types, got {types!r}")
        known = ("full_attention", "sliding_attention")
        bad = [t for t in types if t not in known]
        if bad:
            raise CheckpointError(f"config.json 'layer_types' has {bad[0]!r}; supported: {', '.join(known)}")
        return [window if t == "sliding_attention" else None for t in types]
    return [None] * layers  # llama: full attention


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (rotate-half layout): x (1, h, T, hd), cos/sin (T, hd)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Llama(LoadableLM):
    lm_head: nn.Linear | None
    inv_freq: Tensor
    EMBEDDINGS = ("embed_tokens",)
    LAYERS = "layers"
    FINAL = ("norm", "lm_head")
    TIED_EMBEDDING = "embed_tokens"

    def __init__(self, config: Mapping[str, Any], info: ModelInfo) -> None:
        super().__init__()
        model_type = config["model_type"]
        self.info = info
        if config.get("quantization_config") is not None:
            raise CheckpointError("config.json has a 'quantization_config': quantized weights are not supported")
        if model_type == "llama":
            qkv_bias = o_bias = config_flag(config, "attention_bias", False)
            mlp_bias = config_flag(config, "mlp_bias", False)
        else:
            for key in ("attention_bias", "mlp_bias"):
                refuse_flag(config, key, f"{model_type} has no such variant in transformers")
            qkv_bias, o_bias, mlp_bias = model_type == "qwen2", False, False
        self.act = activation(config.get("hidden_act", "silu"), "hidden_act")
        inner = config_int(config, "intermediate_size")
        eps = config_float(config, "rms_norm_eps", 1e-6)
        self.windows = sliding_windows(config, info.layers)
        self.tied = ties_embeddings(config)
        with torch.device("meta"):  # shapes only: the checkpoint's tensors are assigned on load
            self.embed_tokens = nn.Embedding(info.vocab, info.d_model)
            self.layers = nn.ModuleList(Layer(info, inner, eps, qkv_bias, o_bias, mlp_bias) for _ in range(info.layers))
            self.norm = RMSNorm(info.d_model, eps)
            self.lm_head = None if self.tied else nn.Linear(info.d_model, info.vocab, bias=False)
        # Not a checkpoint tensor: computed here (on the default device; `.to` moves it with the rest).
        self.register_buffer("inv_freq", rope_inv_freq(config, info.head_dim), persistent=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], info: ModelInfo) -> Self:
        return cls(config, info)

    def rename(self, name: str) -> str | None:
        if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
            return None
        return name.removeprefix("model.")

    def checkpoint_name(self, name: str) -> str:
        return name if name == "lm_head.weight" else f"model.{name}"

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        return self.embed_tokens(ids)  # (1, T, C): positions enter through the rotary embedding

    def block(self, i: int, hidden: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        layer = self.layers[i]
        assert isinstance(layer, Layer)
        attn, info = layer.self_attn, self.info
        x = layer.input_layernorm(hidden)
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, info.heads, info.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = attn.k_proj(x).view(B, T, info.kv_heads, info.head_dim).transpose(1, 2)  # (B, kvh, T, hd)
        v = attn.v_proj(x).view(B, T, info.kv_heads, info.head_dim).transpose(1, 2)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hd / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)  # in the weights' dtype (a no-op in float32)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = extend_cache(past, k, v)  # (B, kvh, T_total, hd)
        y = attend(q, k, v, scale=info.head_dim**-0.5, window=self.windows[i])  # (B, h, T, hd)
        hidden = hidden + attn.o_proj(y.transpose(1, 2).reshape(B, T, info.heads * info.head_dim))
        x = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        return hidden + mlp.down_proj(self.act(mlp.gate_proj(x)) * mlp.up_proj(x)), (k, v)

    def logits(self, hidden: Tensor) -> Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(hidden), weight)  # (..., C) -> (..., vocab)

    def head(self, hidden_last: Tensor) -> Tensor:
        return self.logits(hidden_last)[0]  # (1, C) -> (vocab,)
