"""The stage's timing before its first step: what each operation counts for (`Profile`: the spec's
device profile, or the real computation's time), and the analytic model's bubble lengths for its
slot, the predictor's prior before any history (`profile_and_prior`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.stage_worker.membership.lease import Slot
from services.stage_worker.train.trainer import StageTrainer
from shared.config.spec import ClusterSpec
from shared.config.timescale import profile_ms
from shared.model.devices import synchronize
from shared.policies.pipeline_plan import predict

#: Data seed of the start-up timing probe (kept apart from the training data seed).
TIMING_SEED = 0x5EED


@dataclass
class Profile:
    """Seconds each operation counts for; None = as long as the real computation takes."""

    fwd: float | None = None
    bwd: float | None = None
    allreduce: float = 0.0
    step: float = 0.0


def profile_and_prior(spec: ClusterSpec, slot: Slot, trainer: StageTrainer) -> tuple[Profile, dict[int, float]]:
    """The device profile, and the analytic model's bubble lengths for this slot (the prediction
    before any history). Without a profile, per-layer times are measured on this stage."""
    dev = spec.device
    prof = profile_ms(spec)
    if prof is not None:
        fwd_ms, bwd_ms = prof
        layers = trainer.layers
        profile = Profile(
            fwd=fwd_ms * layers / 1000,
            bwd=bwd_ms * layers / 1000,
            allreduce=dev.allreduce_ms / 1000,
            step=dev.step_ms / 1000,
        )
    else:
        fwd_ms, bwd_ms = _measure_ms_per_layer(trainer)
        profile = Profile(allreduce=dev.allreduce_ms / 1000)
    result = predict(spec, fwd_ms, bwd_ms, iterations=2)
    prior = {
        b.position: b.length
        for b in result.bubbles
        if (b.replica, b.stage, b.iteration) == (slot.replica, slot.stage, 1)
    }
    return profile, prior


def _measure_ms_per_layer(trainer: StageTrainer, reps: int = 3) -> tuple[float, float]:
    """Time this stage's forward and backward on a real microbatch (after a warm-up pass), on its
    device (synchronised, so a GPU's time is measured and not its kernel launches)."""
    d_model, dev = trainer.spec.model.d_model, trainer.device
    layers = max(1, trainer.layers)
    fwd, bwd = [], []
    for i in range(reps + 1):
        x, _ = trainer.corpus.batch(0, i, trainer.mbs, trainer.seq, seed=TIMING_SEED)  # not a training batch
        inp: torch.Tensor = (
            x.to(dev)
            if trainer.model.is_first
            else torch.randn(trainer.mbs, trainer.seq, d_model, device=dev, requires_grad=True)
        )
        synchronize(dev)
        t0 = time.perf_counter()
        out = trainer.model(inp)
        synchronize(dev)
        t1 = time.perf_counter()
        out.float().mean().backward()
        synchronize(dev)
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    trainer.model.zero_grad(set_to_none=True)
    return min(fwd) * 1000 / layers, min(bwd) * 1000 / layers
