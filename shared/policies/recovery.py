"""Recovery of a training run from a lost worker (pure): when to checkpoint, where to resume.

A run that checkpoints (`training.checkpoint_every` > 0) survives the loss of a worker: its peers
notice the lease gone, the run pauses, a replacement process takes the free slot, and every worker
resumes from the newest checkpoint that *every* slot wrote (a slot's own newer one is no use: the
others cannot rejoin it). Training is deterministic given the weights, the optimizer state and the
iteration (microbatch j of replica d in iteration i is the same text everywhere), so the losses
after resumption equal those of a run that never stopped.

No I/O here: the worker reads which iterations each slot has checkpointed and asks these functions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

#: The iteration a run resumes *after* when no checkpoint is common to every slot: it starts over
#: from the initial weights at iteration 0.
FROM_SCRATCH = -1


def checkpoint_due(iteration: int, every: int) -> bool:
    """Whether a worker checkpoints after finishing `iteration` (0-based): after every `every`-th."""
    return every > 0 and (iteration + 1) % every == 0


def save_due(iteration: int, every: int, limit: int | None) -> bool:
    """Whether a run asked to save (`bubbletea train --save`) writes its state after `iteration`:
    after every `every`-th (`training.save_every`, 0 = never) and after the last of `limit`."""
    return (limit is not None and iteration == limit - 1) or checkpoint_due(iteration, every)


def clean_stop_iteration(newest: int, limit: int) -> int:
    """Where a run told to stop under `--save` stops: two past the newest iteration any worker
    reported (stages are at most one iteration apart, so none has passed it yet), at most the last."""
    return min(newest + 2, limit - 1)


def resume_after(checkpoints: Mapping[str, Collection[int]], slots: Iterable[str]) -> int:
    """The newest iteration every slot in `slots` has a checkpoint of (training resumes at the next
    one), or `FROM_SCRATCH` if they have none in common."""
    common: set[int] | None = None
    for s in slots:
        have = set(checkpoints.get(s, ()))
        common = have if common is None else common & have
    return max(common) if common else FROM_SCRATCH


def superseded(iterations: Iterable[int], keep: int) -> list[int]:
    """A slot's checkpoints to delete once it wrote a new one: all but the newest `keep`."""
    return sorted(iterations, reverse=True)[keep:]
