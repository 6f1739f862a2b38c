"""The guest model a stage worker builds at set-up (`services.stage_worker.train.warm.guest_model`):
warmed up there, so that a first request does not pay for the process's first forward in its
bubble, and never a reason for training to stop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.stage_worker.train.warm import guest_model
from shared.config.spec import load_spec
from shared.model.prefill import PrefillModel

SPEC = load_spec(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


def test_the_worker_warms_its_prefill_model_at_set_up(caplog: pytest.LogCaptureFixture) -> None:
    warmed: list[int] = []

    class Counting(PrefillModel):
        def warm_up(self, tokens: int = 64) -> float:
            warmed.append(tokens)
            return super().warm_up(tokens)

    built = Counting.from_spec(SPEC.prefill)
    with caplog.at_level("INFO"):
        model = guest_model(SPEC, torch.device("cpu"), built)
    assert model is built and warmed == [64]
    assert any(r.getMessage() == "prefill model warmed up" for r in caplog.records)


def test_a_failing_warm_up_is_logged_and_the_model_kept(caplog: pytest.LogCaptureFixture) -> None:
    """A guest never stops training: a model that fails its warm-up is kept (its failures are the
    guest policy's to judge, batch by batch), and the warning says what it costs."""

    class Broken(PrefillModel):
        def warm_up(self, tokens: int = 64) -> float:
            raise RuntimeError("out of memory")

    built = Broken.from_spec(SPEC.prefill)
    with caplog.at_level("WARNING"):
        assert guest_model(SPEC, torch.device("cpu"), built) is built
    (line,) = [r.getMessage() for r in caplog.records if "warm-up failed" in r.getMessage()]
    assert "first requests pay" in line
