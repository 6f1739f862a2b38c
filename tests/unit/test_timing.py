"""A stage's timing before its first step (`services/stage_worker/train/timing.py`): the device
profile's seconds per operation, or none where the real computation is timed, and the analytic
model's bubble lengths for the slot as the predictor's prior."""

from __future__ import annotations

from typing import Any

import torch

from services.stage_worker.membership.lease import Slot
from services.stage_worker.train.timing import profile_and_prior
from services.stage_worker.train.trainer import StageTrainer
from shared.config.spec import parse_spec
from shared.model.data import ByteCorpus

CORPUS = ByteCorpus(torch.arange(256, dtype=torch.uint8).repeat(16))


def spec(**device: Any) -> Any:
    return parse_spec(
        {
            "datacenters": [{"name": "a", "gpus": 2}],
            "model": {"layers": 4, "d_model": 16, "heads": 2, "seq_len": 8, "seed": 1},
            "parallelism": {"pp": 2, "dp": 1},
            "device": {"kind": "cpu", **device},
            "training": {"microbatches": 2, "microbatch_size": 2, "lr": 1e-2, "seed": 3},
        }
    )


def test_a_device_profile_gives_each_operation_its_seconds_for_the_stages_layers() -> None:
    s = spec(fwd_ms_per_layer=2.0, bwd_ms_per_layer=5.0, allreduce_ms=3.0, step_ms=1.0)
    trainer = StageTrainer(s, 0, 0, CORPUS)
    profile, prior = profile_and_prior(s, Slot(0, 0), trainer)
    layers = trainer.layers
    assert layers == 2
    assert (profile.fwd, profile.bwd, profile.allreduce, profile.step) == (0.004, 0.010, 0.003, 0.001)
    assert prior and all(length > 0 for length in prior.values()), prior


def test_without_a_profile_compute_counts_as_long_as_it_takes_and_the_prior_is_measured() -> None:
    s = spec(allreduce_ms=3.0)
    trainer = StageTrainer(s, 0, 1, CORPUS)
    profile, prior = profile_and_prior(s, Slot(0, 1), trainer)
    assert (profile.fwd, profile.bwd, profile.allreduce, profile.step) == (None, None, 0.003, 0.0)
    assert prior and all(length > 0 for length in prior.values()), prior
    assert all(p.grad is None for p in trainer.model.parameters()), "the timing probe left gradients behind"
