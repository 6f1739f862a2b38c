"""The training model written as a Hugging Face GPT-2 checkpoint directory (`bubbletea train --save`).

The nanoGPT-shaped training model (shared/model/gpt.py) is GPT-2's architecture with three
differences that the checkpoint's `config.json` states, so any GPT-2 reader computes the same
function: the MLP uses the exact GELU (``activation_function: "gelu"``, not GPT-2's tanh
approximation), the output projection is its own matrix (``tie_word_embeddings: false``), and
there is no dropout. The weights are renamed to GPT-2's and its `Conv1D` layers store their
matrices transposed (``(in, out)``) where `nn.Linear` stores ``(out, in)``.

The byte-level tokenizer becomes a `tokenizer.json` that any `tokenizers` reader loads: byte-level
BPE with no merges whose ids are the byte values, so ``encode(text).ids == list(text.encode())``.

The directory holds `config.json`, `model.safetensors` and `tokenizer.json`: what
`prefill.checkpoint` accepts, and what `transformers.GPT2LMHeadModel.from_pretrained` loads.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from shared.model.shape import GPTConfig

#: Our parameter names (as `StageModule` of the full model has them) -> GPT-2's, per block.
_BLOCK = {
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "attn.c_attn.weight": "attn.c_attn.weight",
    "attn.c_attn.bias": "attn.c_attn.bias",
    "attn.c_proj.weight": "attn.c_proj.weight",
    "attn.c_proj.bias": "attn.c_proj.bias",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
    "mlp.c_fc.weight": "mlp.c_fc.weight",
    "mlp.c_fc.bias": "mlp.c_fc.bias",
    "mlp.c_proj.weight": "mlp.c_proj.weight",
    "mlp.c_proj.bias": "mlp.c_proj.bias",
}
_TOP = {
    "wte.weight": "transformer.wte.weight",
    "wpe.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}


def gpt2_config(cfg: GPTConfig) -> dict[str, object]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": 4 * cfg.d_model,
        "activation_function": "gelu",  # exact GELU, as nn.GELU() (GPT-2's own is "gelu_new")
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        "tie_word_embeddings": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "torch_dtype": "float32",
        "bubbletea": "trained by `bubbletea train --save` (nanoGPT-shaped GPT; byte-level tokenizer)",
    }


def gpt2_tensors(state_dict: Mapping[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    """The full model's state_dict (our names) as GPT-2's tensors; `KeyError` names a missing one."""
    out: dict[str, Tensor] = {}
    for ours, theirs in _TOP.items():
        out[theirs] = state_dict[ours]
    for i in range(cfg.layers):
        for ours, theirs in _BLOCK.items():
            t = state_dict[f"blocks.{i}.{ours}"]
            if ours.endswith(".weight") and t.dim() == 2:  # nn.Linear (out, in) -> Conv1D (in, out)
                t = t.t()
            out[f"transformer.h.{i}.{theirs}"] = t
    return {k: v.detach().to("cpu").contiguous().float() for k, v in out.items()}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what the ByteLevel pre-tokenizer uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """A `tokenizer.json` whose ids are byte values (byte-level BPE, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    text: str = tok.to_str()
    return text


def save_gpt2_checkpoint(state_dict: Mapping[str, Tensor], cfg: GPTConfig, directory: str | Path) -> Path:
    """Write `config.json`, `model.safetensors` and `tokenizer.json` into `directory` (created if
    needed); each file is written to a temporary name and renamed, so a reader never sees half."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = gpt2_tensors(state_dict, cfg)
    _atomic(d / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _atomic(d / "config.json", lambda p: p.write_text(json.dumps(gpt2_config(cfg), indent=2) + "\n"))
    # The training corpus is bytes: ids 0..255 (a larger vocab's other ids are never produced).
    _atomic(d / "tokenizer.json", lambda p: p.write_text(byte_tokenizer_json()))
    return d


#: Tokenizer files copied from the trained model's directory into a checkpoint of it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def save_hf_checkpoint(
    tensors: Mapping[str, Tensor], config_json: str, source: str | Path, directory: str | Path
) -> Path:
    """A trained Hugging Face model (`training.model`) as a directory: `config.json` (float32),
    `model.safetensors` (`tensors`, named as the checkpoint stores them) and the source directory's
    tokenizer files. Each file is written to a temporary name and renamed."""
    d, src = Path(directory), Path(source)
    d.mkdir(parents=True, exist_ok=True)
    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    _atomic(d / "model.safetensors", lambda p: save_file(contiguous, str(p), metadata={"format": "pt"}))
    _atomic(d / "config.json", lambda p: p.write_text(config_json))
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (d / name).resolve():
            _atomic(d / name, functools.partial(_copy, src / name))
    return d


def _copy(source: Path, target: Path) -> None:
    target.write_bytes(source.read_bytes())


def _atomic(target: Path, write: Callable[[Path], object]) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # readable by a server running as another user (safetensors writes 0600)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
