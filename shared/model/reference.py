"""Single-process reference training: what PP x DP pipeline training must compute.

Semantics of one iteration `it` (the pipeline workers reproduce exactly these, up to float
rounding from a different summation order):

1. zero all gradients;
2. for every data-parallel replica ``d in range(dp)`` and microbatch ``j in range(microbatches)``:
   ``x, y = corpus.batch(it, d * microbatches + j, microbatch_size, seq_len, data_seed)``,
   ``loss_dj = lm_loss(model(x), y)`` and backward of ``loss_dj / (dp * microbatches)``;
3. gradients clipped by their global norm (`training.clip_grad_norm`), the learning rate of the
   schedule set (`shared.model.optim.lr_at`), one `make_optimizer` (AdamW) step.

The iteration's reported loss is the mean of the ``loss_dj`` (taken before the step). In the
pipeline, each stage replica accumulates the gradients of ``loss_dj / microbatches`` over its
own microbatches, and the gradient all-reduce then averages over the `dp` replicas; the sum is
the same gradient of the mean loss over all ``dp * microbatches`` microbatches. A tied embedding is
one tensor here and two copies there whose gradients are summed: the same gradient.
"""

from __future__ import annotations

import msgspec
from torch import nn

from shared.config.spec import ClusterSpec
from shared.config.training import Parallelism, Training
from shared.model.data import ByteCorpus
from shared.model.gpt import StageModule, build_full, lm_loss
from shared.model.optim import clip_and_step, make_optimizer
from shared.model.shape import GPTConfig
from shared.model.training import Corpus, TrainingStage, build_training_stage, load_corpus


def train_reference(
    cfg: GPTConfig,
    corpus: ByteCorpus,
    *,
    seed: int,
    data_seed: int,
    lr: float,
    iterations: int,
    dp: int,
    microbatches: int,
    microbatch_size: int,
) -> list[float]:
    """Train `build_full(cfg, seed)` for `iterations` steps at a constant `lr` without clipping;
    return each iteration's mean loss. Deterministic (no global RNG is used)."""
    tr = Training(
        lr=lr,
        iterations=iterations,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        seed=data_seed,
        lr_schedule="constant",
        clip_grad_norm=0.0,
    )
    losses, _ = train_model(build_full(cfg, seed), corpus, tr, dp=dp, seq_len=cfg.seq_len)
    return losses


def train_model(
    model: nn.Module,
    corpus: Corpus,
    tr: Training,
    *,
    dp: int,
    seq_len: int,
    iterations: int | None = None,
    per_replica: list[list[float]] | None = None,
) -> tuple[list[float], nn.Module]:
    """Train `model` (the whole model: token ids in, logits out) as `tr` says; the losses and the
    model. `per_replica`, if given, gets each iteration's losses of each replica's microbatches
    (what each replica's last stage reports), appended one list an iteration."""
    iterations = tr.iteration_limit if iterations is None else iterations
    if iterations is None:
        raise ValueError("the reference trains a number of iterations; the spec trains until stopped")
    for name, value in (("iterations", iterations), ("dp", dp), ("microbatches", tr.microbatches)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    model.train()  # no dropout exists; train mode only for form
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, tr.lr)
    parts = dp * tr.microbatches
    losses: list[float] = []
    for it in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        replicas = [0.0] * dp
        for d in range(dp):
            for j in range(tr.microbatches):
                x, y = corpus.batch(it, d * tr.microbatches + j, tr.microbatch_size, seq_len, tr.seed)  # (B, T)
                loss = lm_loss(model(x), y)  # logits (B, T, vocab) -> scalar
                (loss / parts).backward()  # accumulate the gradient of the mean over all microbatches
                replicas[d] += loss.item()
        clip_and_step(optimizer, params, tr, it)
        losses.append(sum(replicas) / parts)
        if per_replica is not None:
            per_replica.append([r / tr.microbatches for r in replicas])
    return losses, model


def single_stage(spec: ClusterSpec) -> ClusterSpec:
    """`spec` with one pipeline stage and one replica: the whole model in one process."""
    return msgspec.structs.replace(spec, parallelism=Parallelism(pp=1, dp=1, tp=1))


def train_reference_for(
    spec: ClusterSpec, iterations: int | None = None, per_replica: list[list[float]] | None = None
) -> tuple[list[float], TrainingStage]:
    """The reference on what a cluster spec trains: its model (the small GPT or `training.model`),
    data, seeds, optimizer and schedule, DP x microbatches of the same global batches (what the
    live pipeline's results are compared with).

    `iterations`: how many to train (None: the spec's; a spec that trains until stopped needs it).
    The schedule stays the spec's: the first `iterations` of a run that trains until stopped keep
    `lr` (or decay to its `decay_iters`), as its workers do, where a spec rewritten to train
    `iterations` would decay over them instead."""
    model = build_training_stage(single_stage(spec), 0)
    losses, _ = train_model(
        model,
        load_corpus(spec),
        spec.training,
        dp=spec.parallelism.dp,
        seq_len=spec.model.seq_len,
        iterations=iterations,
        per_replica=per_replica,
    )
    return losses, model


__all__ = ["StageModule", "train_model", "train_reference", "train_reference_for"]
