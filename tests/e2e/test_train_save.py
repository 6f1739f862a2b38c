"""`bubbletea train --save DIR` as a user runs it: the trained pipeline's weights, gathered from
the live workers, written as a Hugging Face GPT-2 checkpoint that transformers reads as the very
model a single process trains on the same batches."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from bubbletea.launcher.train import run_training
from shared.config.settings import load_settings
from shared.model.gpt import build_full
from shared.model.reference import train_reference_for
from shared.model.shape import GPTConfig
from shared.model.trainstate import saved_iteration
from shared.runtime.redis_server import EmbeddedRedis
from tests.e2e.serving import wait_for_iteration
from tests.e2e.test_training_correctness import ONE_REPLICA, write_spec

ROOT = Path(__file__).resolve().parents[2]


def test_train_save_writes_the_trained_model(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    # one replica (two workers): what is saved is replica 0's stages whatever the DP; data
    # parallelism is pinned by the next test and test_training_correctness.py
    spec_path = write_spec(tmp_path, ONE_REPLICA, iterations=3)
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
    assert f"(set prefill.checkpoint: {out.absolute()} to serve it)" in res.stdout  # as any spec reads it

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


async def test_a_stopped_run_saves_its_last_finished_iteration_and_resumes_from_it(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """Ctrl-C (the launcher's task cancelled) under --save: every worker finishes the same
    iteration, a little ahead, hands its state over and stops, and the launcher writes it; a resume
    then trains the rest with the losses of an uninterrupted run."""
    path = write_spec(tmp_path, iterations=8, checkpoint_every=0)

    def settings() -> Any:
        return load_settings(path, env={"BUBBLETEA_RUN": f"stop-{uuid.uuid4().hex[:6]}"})

    saved = tmp_path / "saved"
    stopped = settings()
    task = asyncio.create_task(run_training(stopped, redis_server.url, out=io.StringIO(), progress=False, save=saved))
    await wait_for_iteration(redis_server.url, stopped.run, 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    at = saved_iteration(saved)
    assert at is not None and 4 <= at < 7  # at least two past the iteration that was reached
    rest = await run_training(settings(), redis_server.url, out=io.StringIO(), progress=False, resume=saved)
    assert rest.first == at + 1
    expected, _ = train_reference_for(stopped.spec)  # what an uninterrupted run computes
    assert rest.losses == pytest.approx(expected[at + 1 :], abs=1e-5)
