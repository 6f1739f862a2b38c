"""`bubbletea init-model DIR`: a new Hugging Face model directory to train, made here, downloading nothing.

It writes `config.json` for the family and shape asked (llama by default; gpt2, mistral and qwen2
too) and a byte-level BPE `tokenizer.json` trained on local text (by default this checkout's
README and docs). There are no weights unless `--weights` asks for them: `training.model: DIR`
initialises the model as its family does, but prefill (`prefill.checkpoint: DIR`) serves weights,
so a directory to serve needs them: `--weights` writes the initialised ones (model.safetensors),
or train it with `bubbletea train --save DIR`.

The vocabulary is the tokenizer's size rounded up to a multiple of 64 (the embedding may be
larger than the tokenizer; never smaller).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Where the default tokenizer text comes from: this checkout's own documentation.
ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "gpt2", "mistral", "qwen2")


def default_texts() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.is_file()]


def model_config(
    family: str, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, positions: int
) -> dict[str, Any]:
    """config.json of a `family` model of this shape, in transformers' keys (float32, no dropout)."""
    if family == "gpt2":
        return {
            "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": layers, "n_embd": hidden,
            "n_head": heads, "n_positions": positions, "vocab_size": vocab, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
            "torch_dtype": "float32",
        }  # fmt: skip
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    config: dict[str, Any] = {
        "model_type": family, "architectures": [arch], "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": _ffn(hidden), "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": positions, "vocab_size": vocab, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "initializer_range": 0.02, "tie_word_embeddings": family == "qwen2",
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
    }  # fmt: skip
    if family == "mistral":
        config["sliding_window"] = None
    return config


def _ffn(hidden: int) -> int:
    """Llama's SwiGLU width: 8/3 of the hidden size, rounded up to a multiple of 32."""
    return -(-(8 * hidden // 3) // 32) * 32


def init_model(
    directory: Path,
    family: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    positions: int,
    tokenizer_vocab: int,
    texts: list[Path],
    weights: bool = False,
) -> dict[str, Any]:
    """Write the directory; returns its config. Every check comes before the import of the tokenizer
    trainer (its module imports torch, 1.5 s): a refusal is said at once."""
    if family not in FAMILIES:
        raise ValueError(f"--family {family!r}: supported: {', '.join(FAMILIES)}")
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv-heads", kv_heads)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    if positions < 2 or tokenizer_vocab < 257:
        raise ValueError(
            f"--positions must be >= 2 and --tokenizer-vocab >= 257, got {positions} and {tokenizer_vocab}"
        )
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"--hidden ({hidden}) must be a multiple of --heads ({heads}), and --heads of --kv-heads")
    missing = [str(p) for p in texts if not p.is_file()]
    if not texts or missing:
        raise ValueError(f"--text: no such files {missing}" if missing else "--text: no text files to train on")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        what = "is not a directory" if not directory.is_dir() else "is not empty"
        raise ValueError(f"{directory} {what}: choose a new or empty directory")
    from shared.model.corpus import train_bpe_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tok = directory / "tokenizer.json"
    train_bpe_tokenizer((p.read_text(encoding="utf-8", errors="replace") for p in texts), tokenizer_vocab, tok)
    size = json.loads(tok.read_text())["model"]["vocab"]
    vocab = -(-(len(size) + 1) // 64) * 64  # the added special token too, rounded up
    config = model_config(
        family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab, positions=positions
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if weights:
        write_initial_weights(directory, config)
    return config


def write_initial_weights(directory: Path, config: dict[str, Any], seed: int = 0) -> None:
    """model.safetensors: the weights the family initialises (the same a run training from this
    directory starts with at `seed`), under the checkpoint's names: what prefill loads."""
    from safetensors.torch import save_file

    from shared.model.hf_stage import HFStage

    layers = int(config.get("num_hidden_layers") or config["n_layer"])
    stage = HFStage(config, stage=0, ranges=[(0, layers)], seed=seed)
    tensors = {name: t.contiguous() for name, t in stage.hf_tensors().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "init-model",
        help="write a new Hugging Face model directory to train (config.json + a tokenizer trained here)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", type=Path, help="the directory to create (new, or empty)")
    p.add_argument("--family", choices=FAMILIES, default="llama", help="the architecture (default: llama)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (default: 4)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default: 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, grouped-query attention (default: 2)")
    p.add_argument("--positions", type=int, default=256, help="max_position_embeddings (default: 256)")
    p.add_argument("--tokenizer-vocab", type=int, default=1000, help="BPE vocabulary to train (default: 1000)")
    p.add_argument(
        "--text",
        type=Path,
        nargs="+",
        default=None,
        help="text files to train the tokenizer on (default: this checkout's README.md and docs/*.md)",
    )
    p.add_argument(
        "--weights",
        action="store_true",
        help="also write the initialised weights (model.safetensors), so prefill can serve the directory",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bubbletea.cli_common import CommandError

    texts = args.text if args.text is not None else default_texts()
    try:
        config = init_model(
            args.dir,
            args.family,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads if args.family != "gpt2" else args.heads,
            positions=args.positions,
            tokenizer_vocab=args.tokenizer_vocab,
            texts=texts,
            weights=args.weights,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    print(
        f"==> {args.dir}: {config['model_type']}, vocab {config['vocab_size']}, a tokenizer trained on "
        f"{len(texts)} files; no weights (training.model initialises it as the family does)"
    )
    print(f"    train it: set training.model: {args.dir} (configs/llama.yaml does) and run bubbletea train")
    return 0
