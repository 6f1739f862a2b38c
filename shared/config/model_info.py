"""The served model's shape (`ModelInfo`), and a Hugging Face checkpoint directory's `config.json`
read into it, without torch and without the cluster spec.

In the config package because `shared.config.spec` reads `training.model`'s shape from here while
it validates a spec; `shared.model.shape` builds on it (`model_info(prefill_spec)`). It imports
neither.
`CheckpointError` is what every torch-free reader of a checkpoint raises.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

FLOAT32_BYTES = 4

#: The `model_type`s of `config.json` that `shared.model.checkpoint` loads.
SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")
#: The file of a checkpoint directory that says what the model is.
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint cannot serve: missing, unreadable, unsupported, or not the shape it claims.

    Raised at start (loading the model, or reading its shape), with a message that says what was
    found and what is supported. Torch-free, so the front door and the dispatcher raise it too.
    """


@dataclass(frozen=True)
class ModelInfo:
    """The shape of the served model, as the planners and the front door need it.

    `family` is "nanogpt" or the checkpoint's `model_type` (gpt2, llama, mistral, qwen2). The KV
    cache keeps `kv_heads` heads of `head_dim` per layer (grouped-query attention stores the shared
    heads once); `max_model_len` is the longest sequence the model can place (its position table).
    """

    family: str
    layers: int
    vocab: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    max_model_len: int
    #: Tokens that end a completion (config.json `eos_token_id`); none for the byte-level nanoGPT.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("family", "eos_token_ids") and getattr(self, f.name) < 1:
                raise ValueError(f"ModelInfo.{f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelInfo.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of a full KV cache for `tokens` positions: k and v, float32, every layer.

        Each layer keeps k and v of shape (1, kv_heads, tokens, head_dim).
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * FLOAT32_BYTES


def read_config(directory: str | Path) -> dict[str, Any]:
    """The `config.json` of a Hugging Face checkpoint directory; `CheckpointError` if there is none."""
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist (nothing is ever downloaded)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory with {CONFIG_FILE}")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        found = sorted(p.name for p in path.iterdir())[:20]
        raise CheckpointError(
            f"checkpoint directory {path} has no {CONFIG_FILE} (found {found}); a Hugging Face model "
            f"directory holds {CONFIG_FILE}, *.safetensors and tokenizer.json"
        )
    return read_json_object(config_path)


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, tokenizer_config.json, ...) as a dict;
    `CheckpointError` naming the file if it cannot be read or holds something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def config_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer of `config.json`; `CheckpointError` naming the key if absent or not one."""
    value = config.get(key, default)
    if value is None:
        raise CheckpointError(f"config.json has no '{key}' (model_type {config.get('model_type')!r})")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"config.json '{key}' must be a positive integer, got {value!r}")
    return value


def config_flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean of `config.json` (`default` if absent or null)."""
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json '{key}' must be true or false, got {value!r}")
    return value


def ties_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether the head reuses the token embedding (`tie_word_embeddings`, by default as the family
    has it: tied for gpt2, untied for the Llama family)."""
    return config_flag(config, "tie_word_embeddings", config.get("model_type") == "gpt2")


def info_from_config(config: Mapping[str, Any]) -> ModelInfo:
    """The `ModelInfo` of a Hugging Face `config.json` (shape only; the families check the rest).

    `CheckpointError` for a `model_type` outside `SUPPORTED_MODEL_TYPES` or a missing or bad size.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"config.json has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gpt2":
        d_model, heads = config_int(config, "n_embd"), config_int(config, "n_head")
        if d_model % heads:
            raise CheckpointError(f"config.json n_embd ({d_model}) is not a multiple of n_head ({heads})")
        return ModelInfo(
            family=model_type,
            layers=config_int(config, "n_layer"),
            vocab=config_int(config, "vocab_size"),
            d_model=d_model,
            heads=heads,
            kv_heads=heads,
            head_dim=d_model // heads,
            max_model_len=config_int(config, "n_positions"),
            eos_token_ids=_eos(config),
        )
    d_model, heads = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
    kv_heads = config_int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"config.json num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    if config.get("head_dim") is None and d_model % heads:  # transformers derives it so
        raise CheckpointError(
            f"config.json hidden_size ({d_model}) is not a multiple of num_attention_heads ({heads}) "
            "and there is no head_dim"
        )
    return ModelInfo(
        family=model_type,
        layers=config_int(config, "num_hidden_layers"),
        vocab=config_int(config, "vocab_size"),
        d_model=d_model,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=config_int(config, "head_dim", d_model // heads),
        max_model_len=config_int(config, "max_position_embeddings"),
        eos_token_ids=_eos(config),
    )


def _eos(config: Mapping[str, Any]) -> tuple[int, ...]:
    """config.json's `eos_token_id`: an id, a list of ids, or absent/null (then none)."""
    value = config.get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"config.json 'eos_token_id' must be a token id or a list of them, got {value!r}")
    return tuple(ids)
