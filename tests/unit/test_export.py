"""`bubbletea train --save` writes a GPT-2 checkpoint that Hugging Face's own code reads as the
same model: transformers is the reference here (tests only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from shared.model.export import save_gpt2_checkpoint
from shared.model.gpt import build_full
from shared.model.shape import GPTConfig


def test_the_saved_checkpoint_is_the_same_model_for_transformers(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    cfg = GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256)
    ours = build_full(cfg, seed=5).eval()
    save_gpt2_checkpoint(ours.state_dict(), cfg, tmp_path / "ckpt")
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    assert all((p.stat().st_mode & 0o444) == 0o444 for p in (tmp_path / "ckpt").iterdir())  # readable by all
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt").eval()
    ids = torch.tensor([list(b"The quick brown fox")])
    with torch.no_grad():
        want = ours(ids)
        got = theirs(ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["activation_function"] == "gelu"


def test_the_saved_tokenizer_maps_bytes_to_their_values(tmp_path: Path) -> None:
    cfg = GPTConfig(layers=1, d_model=8, heads=2, seq_len=8, vocab=256)
    save_gpt2_checkpoint(build_full(cfg, seed=0).state_dict(), cfg, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "héllo wörld\n\t~ 😀"
    assert tok.encode(text).ids == list(text.encode())
    assert tok.decode(list(text.encode())) == text
    assert tok.get_vocab_size() == 256
