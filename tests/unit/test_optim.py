"""The learning-rate schedule, clipping and the params-balanced stage split: exact values."""

from __future__ import annotations

import math

import pytest
import torch

from shared.config.spec import parse_spec
from shared.config.training import Training
from shared.model.optim import clip_coefficient, grad_sq_norm, lr_at
from shared.model.shape import balanced_split, stage_layer_ranges


def test_warmup_then_cosine_to_the_floor_then_flat() -> None:
    tr = Training(lr=1.0, iterations=10, warmup_iters=2, min_lr_ratio=0.1)
    assert [lr_at(tr, i) for i in range(2)] == [0.5, 1.0]
    assert lr_at(tr, 2) == pytest.approx(1.0)  # the cosine starts at lr
    assert lr_at(tr, 6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert lr_at(tr, 10) == lr_at(tr, 50) == pytest.approx(0.1)
    assert all(lr_at(tr, i) >= lr_at(tr, i + 1) for i in range(2, 12))


def test_constant_and_until_stopped_keep_lr_after_the_warmup() -> None:
    assert [lr_at(Training(lr=2.0, lr_schedule="constant", warmup_iters=4), i) for i in (0, 3, 9)] == [0.5, 2.0, 2.0]
    forever = Training(lr=2.0, iterations="until_stopped")
    assert lr_at(forever, 10**6) == 2.0
    assert lr_at(Training(lr=2.0, iterations="until_stopped", decay_iters=10), 10) == pytest.approx(0.2)


def test_clip_coefficient_is_torchs() -> None:
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert clip_coefficient(1e9, 0.0) == 1.0  # off


def test_balanced_split_gives_big_end_stages_fewer_layers() -> None:
    assert balanced_split([1.0] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert balanced_split([4, 1, 1, 1, 1, 1, 1, 4], 3) == [(0, 2), (2, 7), (7, 8)]
    assert balanced_split([1.0, 1.0], 2) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="at least one layer each"):
        balanced_split([1.0], 2)


def test_the_params_split_moves_layers_off_the_embedding_and_head_stages() -> None:
    spec = {
        "datacenters": [{"name": "a", "gpus": 4}],
        "model": {"layers": 8, "d_model": 64, "heads": 4, "vocab": 32_000},
        "parallelism": {"pp": 4, "dp": 1},
    }
    by_layers = stage_layer_ranges(parse_spec(spec))
    by_params = stage_layer_ranges(parse_spec({**spec, "parallelism": {"pp": 4, "dp": 1, "split": "params"}}))
    assert by_layers == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert by_params[0] == (0, 1) and by_params[-1] == (7, 8)  # vocab x d_model outweighs the layers


def test_the_squared_norm_is_read_from_the_device_once_and_equals_the_per_parameter_sum() -> None:
    """One host read for all the parameters (issue 62: a `float()` each was a device sync each), the
    same value to the last bit as adding each parameter's sum on the host in order."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((7, 3), (11,), (2, 2, 5))]
    for p in params[:2]:  # the last has no gradient: it counts 0
        p.grad = torch.randn_like(p) * 1e3
    by_hand = 0.0
    for p in params[:2]:
        by_hand += float(p.grad.detach().double().pow(2).sum())  # type: ignore[union-attr]
    assert grad_sq_norm(params) == by_hand
    assert grad_sq_norm([torch.nn.Parameter(torch.zeros(3))]) == 0.0
