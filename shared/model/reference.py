"""Single-process reference training: what PP x DP pipeline training must compute.

Semantics of one iteration `it` (the pipeline workers reproduce exactly these, up to float
rounding from a different summation order):

1. zero all gradients;
2. for every data-parallel replica ``d in range(dp)`` and microbatch ``j in range(microbatches)``:
   ``x, y = corpus.batch(it, d * microbatches + j, microbatch_size, cfg.seq_len, data_seed)``,
   ``loss_dj = lm_loss(model(x), y)`` and backward of ``loss_dj / (dp * microbatches)``;
3. one `make_optimizer` (AdamW) step.

The iteration's reported loss is the mean of the ``loss_dj`` (taken before the step). In the
pipeline, each stage replica accumulates the gradients of ``loss_dj / microbatches`` over its
own microbatches, and the gradient all-reduce then averages over the `dp` replicas; the sum is
the same gradient of the mean loss over all ``dp * microbatches`` microbatches.
"""

from __future__ import annotations

from shared.config import ClusterSpec
from shared.model.data import ByteCorpus
from shared.model.gpt import StageModule, build_full, lm_loss, make_optimizer
from shared.model.shape import GPTConfig


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
    """Train `build_full(cfg, seed)` for `iterations` steps; return each iteration's mean loss.

    Deterministic: the same arguments give the same losses (no global RNG is used).
    """
    losses, _ = train_reference_model(
        cfg,
        corpus,
        seed=seed,
        data_seed=data_seed,
        lr=lr,
        iterations=iterations,
        dp=dp,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
    )
    return losses


def train_reference_model(
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
) -> tuple[list[float], StageModule]:
    """`train_reference`, also returning the trained model (to compare saved weights with)."""
    for name, value in (("iterations", iterations), ("dp", dp), ("microbatches", microbatches)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    model = build_full(cfg, seed)
    model.train()  # no dropout exists; train mode only for form
    optimizer = make_optimizer(model.parameters(), lr)
    parts = dp * microbatches
    losses: list[float] = []
    for it in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for d in range(dp):
            for j in range(microbatches):
                x, y = corpus.batch(it, d * microbatches + j, microbatch_size, cfg.seq_len, data_seed)  # (B, T) each
                loss = lm_loss(model(x), y)  # logits (B, T, vocab) -> scalar
                (loss / parts).backward()  # accumulate the gradient of the mean over all microbatches
                total += loss.item()
        optimizer.step()
        losses.append(total / parts)
    return losses, model


def train_reference_for(spec: ClusterSpec) -> tuple[list[float], StageModule]:
    """`train_reference_model` on what a cluster spec trains: the model, seeds, optimizer, DP x
    microbatches of the same global batches (what the live pipeline's results are compared with)."""
    tr = spec.training
    iterations = tr.iteration_limit
    if iterations is None:
        raise ValueError("the reference trains a number of iterations; the spec trains until stopped")
    return train_reference_model(
        GPTConfig.from_spec(spec.model),
        ByteCorpus.from_stdlib(),
        seed=spec.model.seed,
        data_seed=tr.seed,
        lr=tr.lr,
        iterations=iterations,
        dp=spec.parallelism.dp,
        microbatches=tr.microbatches,
        microbatch_size=tr.microbatch_size,
    )
