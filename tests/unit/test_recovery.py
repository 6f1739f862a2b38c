"""Recovery from a lost worker: the pure policy (when to checkpoint, where to resume) and the
trainer's checkpoint, which must continue a run bit for bit."""

from __future__ import annotations

import torch

from services.stage_worker.train.trainer import StageTrainer
from shared.config.spec import parse_spec
from shared.model.data import ByteCorpus
from shared.policies.recovery import (
    FROM_SCRATCH,
    OWN_CHECKPOINT,
    Resume,
    Source,
    checkpoint_due,
    clean_stop_iteration,
    needs_state,
    plan_resume,
    reports_cut_short,
    resume_after,
    save_due,
    still_leaving,
    superseded,
    whole_run_stops,
)

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


NAMES = {(d, k): f"r{d}s{k}" for d in range(2) for k in range(2)}


def test_a_lost_worker_takes_the_newest_state_from_a_live_peer_of_its_stage() -> None:
    """PP=2 x DP=2, r0s1 replaced (a fresh process: nothing stepped). Every stage has a live worker
    at iteration 6: the run goes on after it, stage 1's state handed over by replica 1; nobody
    rewinds to the checkpoint of iteration 5, though every slot has one."""
    stepped = {(0, 0): 6, (1, 0): 6, (0, 1): FROM_SCRATCH, (1, 1): 6}
    checkpoints = {name: [3, 5] for name in NAMES.values()}
    plan = plan_resume(stepped, checkpoints, NAMES)
    assert plan == Resume(6, Source.PEERS, ((1, 1),))
    assert plan.source_of(1) == 1 and plan.source_of(0) is None
    assert needs_state(plan, 0, 1, FROM_SCRATCH) and not needs_state(plan, 1, 1, 6) and not needs_state(plan, 0, 0, 6)
    assert Resume.decode(plan.encode()) == plan


def test_a_replica_that_stepped_past_the_others_hands_its_state_to_them() -> None:
    """r0s0 died after its gradient all-reduce: replica 1 stepped iteration 7, replica 0's live
    workers did not (their step waited on the lost worker). The run goes on after 7, each stage
    taking replica 1's state: iteration 7 is not trained twice."""
    stepped = {(0, 0): FROM_SCRATCH, (1, 0): 7, (0, 1): 6, (1, 1): 7}
    plan = plan_resume(stepped, {}, NAMES)
    assert plan == Resume(7, Source.PEERS, ((0, 1), (1, 1)))
    assert needs_state(plan, 0, 1, 6) and needs_state(plan, 0, 0, FROM_SCRATCH) and not needs_state(plan, 1, 0, 7)


def test_a_stage_with_no_live_worker_holding_the_newest_state_resumes_from_the_checkpoint() -> None:
    one_replica = {(0, 0): "r0s0", (0, 1): "r0s1"}
    plan = plan_resume({(0, 0): 6, (0, 1): FROM_SCRATCH}, {"r0s0": [3, 5], "r0s1": [3, 5]}, one_replica)
    assert plan == Resume(5, Source.CHECKPOINT) and needs_state(plan, 0, 0, 6)  # every worker restores
    # no checkpoint in common: from the initial weights
    assert plan_resume({(0, 0): 6, (0, 1): FROM_SCRATCH}, {"r0s0": [5]}, one_replica) == Resume(-1, Source.SCRATCH)
    # nothing stepped anywhere: a fresh start, or the whole job started again (from its checkpoint)
    assert plan_resume({(0, 0): -1, (0, 1): -1}, {}, one_replica) == Resume(-1, Source.SCRATCH)
    assert plan_resume({(0, 0): -1, (0, 1): -1}, {"r0s0": [3], "r0s1": [3]}, one_replica) == Resume(
        3, Source.CHECKPOINT
    )


def test_a_drained_worker_of_one_replica_hands_its_state_over_through_its_own_checkpoint() -> None:
    """DP = 1: r0s1 left after iteration 6, writing its slot's checkpoint of 6 (outside the cadence
    of every 5); r0s0 holds 6 live. The replacement takes r0s1's file, r0s0 keeps its state."""
    one_replica = {(0, 0): "r0s0", (0, 1): "r0s1"}
    checkpoints = {"r0s0": [4], "r0s1": [4, 6]}
    plan = plan_resume({(0, 0): 6, (0, 1): FROM_SCRATCH}, checkpoints, one_replica)
    assert plan == Resume(6, Source.PEERS, ((1, OWN_CHECKPOINT),)) and plan.source_of(1) == OWN_CHECKPOINT
    assert Resume.decode(plan.encode()) == plan
    assert needs_state(plan, 0, 1, FROM_SCRATCH) and not needs_state(plan, 0, 0, 6)


def test_one_worker_leaving_is_a_drain_and_more_at_once_stop_the_run() -> None:
    assert not whole_run_stops(marked_stopping=False, leaving=1, slots=4)  # an eviction: a drain
    assert whole_run_stops(marked_stopping=False, leaving=2, slots=4)  # compose down, scancel, ...
    assert whole_run_stops(marked_stopping=True, leaving=1, slots=4)  # its launcher stops it
    assert whole_run_stops(marked_stopping=False, leaving=1, slots=1)  # a run of one slot


def test_a_slot_is_leaving_only_while_the_holder_told_to_leave_still_holds_it() -> None:
    """Issue 62: a leaver that died before handing its slot over made the next single drain look
    like two at once, and stopped the run."""
    told = [b"w1", b"w2", None, b"w4"]
    held = [b"w1", None, b"w3", b"w5"]  # w2 died (its lease expired); w5 took w4's slot since
    assert still_leaving(told, held) == 1
    assert not whole_run_stops(marked_stopping=False, leaving=still_leaving(told, held), slots=4)
    assert still_leaving([b"w1", b"w2"], [b"w1", b"w2"]) == 2  # SIGTERM to both: a stop


def test_a_live_worker_keeps_its_state_and_drops_only_the_cut_short_iteration() -> None:
    kept = StageTrainer(SPEC, 0, 0, CORPUS)
    train(kept, range(3))
    assert kept.stepped == 2
    blob = kept.checkpoint()
    expected = train(StageTrainer(SPEC, 0, 0, CORPUS), range(6))[3:]
    kept.forward(3, 0, None)  # iteration 3 cut short
    kept.discard()
    assert kept.stepped == 2 and train(kept, range(3, 6)) == expected
    handed = StageTrainer(SPEC, 0, 0, CORPUS)  # a replacement given the peer's state
    handed.restore(blob, 2)
    assert handed.stepped == 2 and train(handed, range(3, 6)) == expected


def test_a_worker_cut_short_after_its_step_reports_that_iteration_at_its_join() -> None:
    """Iteration 7 in progress: stepped (the recovery cut it short before its report) and the run
    goes on from 7 or later: reported at the join. Not stepped, or rewound past: not (the run trains
    it again and reports it then). Nothing in progress: nothing to report."""
    on_from_7, on_from_8 = Resume(7, Source.PEERS, ()), Resume(8, Source.PEERS, ((0, 0),))
    rewound = Resume(5, Source.CHECKPOINT)
    assert reports_cut_short(7, 7, on_from_7) and reports_cut_short(7, 7, on_from_8)
    assert not reports_cut_short(7, 6, on_from_7)  # cut short before its step
    assert not reports_cut_short(7, 7, rewound)
    assert not reports_cut_short(None, 7, on_from_7)
