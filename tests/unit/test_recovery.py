"""Recovery from a lost worker: the pure policy (when to checkpoint, where to resume) and the
trainer's checkpoint, which must continue a run bit for bit."""

from __future__ import annotations

import torch

from services.stage_worker.trainer import StageTrainer
from shared.model.data import ByteCorpus
from shared.policies.recovery import (
    FROM_SCRATCH,
    checkpoint_due,
    clean_stop_iteration,
    resume_after,
    save_due,
    superseded,
)
from shared.spec.config import parse_spec

SPEC = parse_spec(
    {
        "datacenters": [{"name": "a", "gpus": 1}],
        "model": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8, "seed": 1},
        "parallelism": {"pp": 1, "dp": 1},
        "device": {"kind": "cpu"},
        "training": {"microbatches": 2, "microbatch_size": 2, "lr": 1e-2, "seed": 3},
    }
)
CORPUS = ByteCorpus(torch.arange(256, dtype=torch.uint8).repeat(16))


def test_checkpoints_come_after_every_nth_iteration_and_never_when_off() -> None:
    assert [i for i in range(10) if checkpoint_due(i, 3)] == [2, 5, 8]
    assert not any(checkpoint_due(i, 0) for i in range(10))


def test_the_run_resumes_after_the_newest_checkpoint_every_slot_has() -> None:
    slots = ["r0s0", "r0s1", "r1s0"]
    assert resume_after({"r0s0": [3, 5], "r0s1": [3, 5], "r1s0": [1, 3]}, slots) == 3  # r1s0 lags one behind
    assert resume_after({"r0s0": [5, 7], "r0s1": [5, 7], "r1s0": [5, 7]}, slots) == 7
    assert resume_after({"r0s0": [1], "r0s1": [1]}, slots) == FROM_SCRATCH  # r1s0 has none
    assert resume_after({}, slots) == FROM_SCRATCH


def test_a_slot_keeps_only_its_newest_checkpoints() -> None:
    assert superseded([1, 3, 5], keep=2) == [1]
    assert superseded([5, 3], keep=2) == []


def train(t: StageTrainer, iterations: range) -> list[float]:
    losses = []
    for it in iterations:
        for mb in range(t.m):
            t.forward(it, mb, None)
            t.backward(mb, None)
        t.step(it)
        loss = t.take_loss()
        assert loss is not None
        losses.append(loss)
    return losses


def test_a_restored_checkpoint_continues_exactly_as_the_run_that_never_stopped() -> None:
    uninterrupted = StageTrainer(SPEC, 0, 0, CORPUS)
    train(uninterrupted, range(3))
    blob = uninterrupted.checkpoint()
    expected = train(uninterrupted, range(3, 6))

    replacement = StageTrainer(SPEC, 0, 0, CORPUS)  # a new process: initial weights
    replacement.forward(0, 0, None)  # a cut-short iteration's leftovers are dropped by restore
    replacement.restore(blob)
    assert train(replacement, range(3, 6)) == expected  # bit for bit: same weights, moments, step count


def test_restoring_nothing_starts_over_from_the_initial_weights() -> None:
    fresh = StageTrainer(SPEC, 0, 0, CORPUS)
    expected = train(fresh, range(2))
    trained = StageTrainer(SPEC, 0, 0, CORPUS)
    train(trained, range(4))
    trained.restore(None)
    assert train(trained, range(2)) == expected


def test_a_save_is_due_every_save_every_iterations_and_after_the_last() -> None:
    assert [i for i in range(10) if save_due(i, 4, 10)] == [3, 7, 9]
    assert [i for i in range(10) if save_due(i, 0, 10)] == [9]
    assert not any(save_due(i, 0, None) for i in range(10))  # until stopped, no save_every: none


def test_a_clean_stop_lands_two_past_the_newest_iteration_but_not_past_the_last() -> None:
    assert clean_stop_iteration(3, 10) == 5
    assert clean_stop_iteration(8, 10) == 9
    assert clean_stop_iteration(-1, 10) == 1  # nothing reported yet
