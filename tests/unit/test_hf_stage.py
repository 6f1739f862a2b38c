"""Hugging Face families cut into pipeline stages that train: the stages compose to transformers'
model, initialise as the family does, keep the full model's names, and save what transformers loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from shared.model.hf_stage import HFStage
from shared.model.shape import split_layers

IDS = torch.tensor([[5, 17, 260, 3, 99, 42, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


def save_random(family: str, directory: Path) -> dict[str, Any]:
    torch.manual_seed(1)
    model: Any
    if family == "gpt2":  # tied head
        model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=3, n_head=4, n_positions=32))
    else:  # qwen2: biases on q, k, v; tied head
        cfg = Qwen2Config(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
        )  # fmt: skip
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(directory)
    return dict(json.loads((directory / "config.json").read_text()))


def stages_of(config: dict[str, Any], n: int, **kw: Any) -> list[HFStage]:
    ranges = split_layers(config.get("n_layer", config.get("num_hidden_layers")), n)
    return [HFStage(config, stage=s, ranges=ranges, seed=3, **kw) for s in range(n)]


def run(stages: list[HFStage], ids: torch.Tensor) -> torch.Tensor:
    x = ids
    for s in stages:
        x = s(x)
    return x


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_stages_loaded_from_a_checkpoint_compose_to_transformers_logits(tmp_path: Path, family: str) -> None:
    config = save_random(family, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
        for n in (1, 2, 3):
            assert torch.allclose(run(stages_of(config, n, weights=tmp_path), IDS), expected, atol=1e-5), n


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_initialised_stages_agree_and_save_what_transformers_loads(tmp_path: Path, family: str) -> None:
    config = save_random(family, tmp_path / "src")
    stages = stages_of(config, 3)
    first, middle, last = stages
    assert first.tied and last.holds_tied_copy and not middle.holds_tied_copy
    embed = first.lm.TIED_EMBEDDING
    assert torch.equal(getattr(first.lm, embed).weight, getattr(last.lm, embed).weight)  # the copies start equal
    assert getattr(middle.lm, embed) is None
    tensors: dict[str, torch.Tensor] = {}
    for s in stages:
        mine = s.hf_tensors()
        assert not set(mine) & set(tensors)  # each tensor saved by one stage: the tied copy left out
        tensors.update(mine)
    whole = stages_of(config, 1)[0].hf_tensors()
    assert set(tensors) == set(whole) and all(torch.equal(tensors[k], whole[k]) for k in whole)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(run(stages, IDS), loaded(input_ids=IDS).logits, atol=1e-5)


def test_initialisation_follows_the_family(tmp_path: Path) -> None:
    config = save_random("gpt2", tmp_path)
    config["initializer_range"] = 0.05
    (stage,) = stages_of(config, 1)
    named = dict(stage.lm.named_parameters())
    assert named["wte.weight"].std().item() == pytest.approx(0.05, rel=0.05)
    residual = torch.cat([named[f"h.{i}.mlp.c_proj.weight"].reshape(-1) for i in range(3)])
    assert residual.std().item() == pytest.approx(0.05 / (2 * 3) ** 0.5, rel=0.05)  # GPT-2's scaled residuals
    assert torch.equal(named["h.0.ln_1.weight"], torch.ones(32)) and not named["h.0.attn.c_attn.bias"].any()


def test_a_stage_keeps_the_full_models_names() -> None:
    config = {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "max_position_embeddings": 16,
    }  # fmt: skip
    second = stages_of(config, 2)[1]
    names = {ckpt for _, ckpt, _ in second.checkpoint_names()}
    assert "model.layers.2.mlp.up_proj.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.", "model.embed_tokens")) for n in names)
