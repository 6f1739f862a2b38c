"""`bubbletea train --save DIR` as a user runs it: the trained pipeline's weights, gathered from
the live workers, written as a Hugging Face GPT-2 checkpoint that transformers reads as the very
model a single process trains on the same batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from shared.model.gpt import build_full
from shared.model.reference import train_reference_for
from shared.model.shape import GPTConfig
from shared.settings import load_settings
from tests.e2e.test_training_correctness import SPEC

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_train_save_writes_the_trained_model(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({**SPEC, "training": {**SPEC["training"], "iterations": 3}}))
    out = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # its own embedded Redis
    res = subprocess.run(
        [sys.executable, "-m", "bubbletea.cli", "train", "--config", str(spec_path), "--save", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"saved the trained model to {out}" in res.stdout

    spec = load_settings(spec_path).spec
    cfg = GPTConfig.from_spec(spec.model)
    _, reference = train_reference_for(spec)
    saved = GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.tensor([list(b"to be or not to")])
    with torch.no_grad():
        want, got = reference.eval()(ids), saved(ids).logits
    # The pipeline's all-reduce sums gradients in another order than one process: equal to ~1e-6.
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    with torch.no_grad():
        untrained = build_full(cfg, spec.model.seed).eval()(ids)
    assert not torch.allclose(got, untrained, atol=1e-4)  # what was saved is the trained model
