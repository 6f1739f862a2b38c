"""What every trainer of the project steps with: AdamW, the learning-rate schedule, global-norm clipping.

The pipeline's stages and the single-process reference use these same functions, so a PP x DP run
and one process compute the same updates (up to the summation order of the norm):

* `make_optimizer`: AdamW, betas (0.9, 0.95), eps 1e-8, no weight decay, the per-parameter
  implementation (a stage holding a subset of the parameters updates each exactly as the whole
  model's optimizer would);
* `lr_at(training, it)`: linear warm-up to `lr` over `warmup_iters` (iteration `it` < warmup gets
  ``lr * (it + 1) / warmup_iters``), then with `cosine` a half-cosine from `lr` down to
  ``lr * min_lr_ratio`` at `decay_iters` (default: the run's iterations), flat after; a run that
  trains until stopped and names no `decay_iters` keeps `lr` (it has no end to decay towards);
* `clip_and_step(optimizer, params, training, it, total_sq_norm)`: both, then AdamW;
* `clip_coefficient(total_norm, max_norm)`: what torch's `clip_grad_norm_` multiplies gradients by,
  ``min(1, max_norm / (total_norm + 1e-6))``; 1 with clipping off (`max_norm` 0). The total norm is
  over every parameter of the model, so a pipeline sums its stages' squared norms first (a tied
  embedding counted once).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from shared.config.training import Training

#: torch's `clip_grad_norm_` adds this to the norm before dividing.
CLIP_EPS = 1e-6


def make_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW, betas (0.9, 0.95), eps 1e-8, no weight decay; `foreach=False` pins the
    per-parameter implementation (see the module docstring)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)


def lr_at(tr: Training, it: int) -> float:
    """The learning rate of iteration `it` (0-based) under `tr`'s schedule."""
    if it < tr.warmup_iters:
        return tr.lr * (it + 1) / tr.warmup_iters
    if tr.lr_schedule == "constant":
        return tr.lr
    end = tr.decay_iters if tr.decay_iters is not None else tr.iteration_limit
    if end is None:  # trains until stopped, no horizon given
        return tr.lr
    floor = tr.lr * tr.min_lr_ratio
    if it >= end:
        return floor
    span = end - tr.warmup_iters
    if span <= 0:
        return floor
    progress = (it - tr.warmup_iters) / span  # in [0, 1)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tr.lr - floor)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor gradients are scaled by (1 = unchanged)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + CLIP_EPS))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_sq_norm(params: Iterable[nn.Parameter]) -> float:
    """Sum of the squared gradient entries, in float64 (parameters without a gradient count 0): a
    pipeline adds its stages' sums before the square root. One read from the device for all the
    parameters (a `float()` each was a host sync each, issue 62), summed on the host in their order,
    as before: the same value to the last bit."""
    sums = [p.grad.detach().double().pow(2).sum() for p in params if p.grad is not None]
    return sum(torch.stack(sums).cpu().tolist(), 0.0) if sums else 0.0


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    tr: Training,
    it: int,
    total_sq_norm: float | None = None,
) -> tuple[float, float | None]:
    """Iteration `it`'s step: gradients scaled by `clip_coefficient` of the global norm
    (``sqrt(total_sq_norm)``; None: `params`' own), AdamW at `lr_at(tr, it)`. Returns the learning
    rate and the norm (None with clipping off). The gradients are left for the caller to zero."""
    norm = None
    if tr.clip_grad_norm > 0:
        norm = math.sqrt(grad_sq_norm(params) if total_sq_norm is None else total_sq_norm)
        coef = clip_coefficient(norm, tr.clip_grad_norm)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    lr = lr_at(tr, it)
    set_lr(optimizer, lr)
    optimizer.step()
    return lr, norm
