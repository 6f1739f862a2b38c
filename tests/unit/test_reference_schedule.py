"""The reference a run is held to trains the run's own learning-rate schedule, and bench/chaos.py
checks a run trained until stopped (`bubbletea up`) against it.

A run that trains until stopped keeps `lr` after the warm-up unless `decay_iters` (or
BUBBLETEA_DECAY_ITERS) gives its cosine an end. Chaos once held such a run to a spec rewritten to
train the iterations it checked, whose cosine decayed over them: losses_equal false from the third
iteration (0.022-0.062 off by the last) for a run that had trained exactly right.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench import chaos
from shared.config.spec import ClusterSpec, parse_spec
from shared.model.reference import train_reference_for
from shared.wire import IterationDone

#: The e2e tier's small pipeline (PP=2 x DP=2), trained here by the single-process reference only.
SPEC: dict[str, Any] = {
    "datacenters": [{"name": "dc-a", "gpus": 2}, {"name": "dc-b", "gpus": 2}],
    "model": {"layers": 4, "d_model": 32, "heads": 4, "seq_len": 16, "vocab": 256, "seed": 3},
    "parallelism": {"pp": 2, "dp": 2, "tp": 1},
    "device": {"kind": "cpu"},
    "training": {"microbatches": 3, "microbatch_size": 2, "lr": 3e-3, "seed": 7},
}
CHECKED = 4


def spec(**training: Any) -> ClusterSpec:
    return parse_spec({**SPEC, "training": {**SPEC["training"], **training}})


def reports(losses: list[list[float]], generation: int = 0) -> list[IterationDone]:
    """What the last stage of both replicas reports for each iteration: its replica's loss."""
    return [
        IterationDone(run="r", replica=d, stage=1, iteration=i, started=0.0, ended=0.0, loss=x, generation=generation)
        for i, per_replica in enumerate(losses)
        for d, x in enumerate(per_replica)
    ]


def replica_losses(trained: ClusterSpec, iterations: int) -> list[list[float]]:
    out: list[list[float]] = []
    train_reference_for(trained, iterations=iterations, per_replica=out)
    return out


def test_the_reference_of_a_run_trained_until_stopped_follows_its_schedule_not_the_iterations_checked() -> None:
    forever, _ = train_reference_for(spec(iterations="until_stopped"), iterations=CHECKED)
    constant, _ = train_reference_for(spec(iterations=CHECKED, lr_schedule="constant"))
    assert forever == constant  # no horizon: `lr` throughout, bit for bit

    horizon, _ = train_reference_for(spec(iterations="until_stopped", decay_iters=3), iterations=CHECKED)
    finite, _ = train_reference_for(spec(iterations=CHECKED, decay_iters=3))
    assert horizon == finite  # the cosine ends at decay_iters, whatever the run's length

    # what chaos compared with: a spec rewritten to end at the iterations checked decays over them
    rewritten, _ = train_reference_for(spec(iterations=CHECKED))
    assert rewritten[:2] == forever[:2] and rewritten[2] != forever[2]

    with pytest.raises(ValueError, match="trains until stopped"):
        train_reference_for(spec(iterations="until_stopped"))


def test_chaos_holds_a_resumed_run_to_the_schedule_it_trained_and_says_why_not() -> None:
    trained = spec(iterations="until_stopped", decay_iters=3)
    losses = replica_losses(trained, CHECKED)
    # generation 1 resumed after iteration 1 and trained 2 and 3 again: the same losses
    done = reports(losses[:CHECKED]) + reports(losses, generation=1)[4:]
    figures = chaos.training_figures(done, trained)
    assert figures["iterations_checked"] == CHECKED and figures["iterations_trained_twice"] == 4
    assert figures["training_resumed"] and figures["losses_equal"] and figures["loss_max_abs_err"] == 0.0
    ok = chaos.verdict(figures, lost=0, duplicated=0, up_exit_code=0)
    assert ok["valid"] and ok["claims_met"] and "4 checked" in ok["why"]

    # held to the iterations checked instead of its own horizon, the same run is wrong from iteration 2
    wrong = chaos.training_figures(done, spec(iterations=CHECKED))
    assert not wrong["losses_equal"] and wrong["first_unequal_iteration"] == 2
    bad = chaos.verdict(wrong, lost=0, duplicated=0, up_exit_code=0)
    assert bad["valid"] is False and "from iteration 2" in bad["why"]
    assert all(bad["claims"].values()) and bad["claims_met"] is False  # a run that is not valid meets nothing

    # a replay that trained something else is not valid either, even when the newest losses agree
    cut_short = reports([*losses[:2], [x + 1e-3 for x in losses[2]], losses[3]])  # generation 0 trained 2 wrong
    replayed = chaos.training_figures(cut_short + reports(losses, generation=1)[4:], trained)
    assert replayed["loss_max_abs_err"] == 0.0 and replayed["replay_max_abs_err"] > 1e-5
    wrong_replay = chaos.verdict(replayed, lost=0, duplicated=0, up_exit_code=0)
    assert wrong_replay["valid"] is False and "trained twice" in wrong_replay["why"]


def test_a_replica_whose_step_never_came_leaves_only_the_others_loss_and_it_is_checked() -> None:
    """Live recovery: replica 1 stepped iteration 2, replica 0's step never came (its worker lost)
    and it went on from replica 1's state: iteration 2 has replica 1's loss only, checked against
    replica 1's in the reference; a wrong one is caught."""
    trained = spec(iterations="until_stopped", decay_iters=3)
    losses = replica_losses(trained, CHECKED)
    done = [m for m in reports(losses) if not (m.iteration == 2 and m.replica == 0)]
    figures = chaos.training_figures(done, trained)
    assert figures["iterations_checked"] == CHECKED and figures["losses_equal"], figures
    assert losses[2][0] != losses[2][1]  # per replica: the mean of both would not have matched
    wrong = [
        m if (m.iteration, m.replica) != (2, 1) else IterationDone(**{**_fields(m), "loss": m.loss + 1e-3})
        for m in done
    ]
    assert chaos.training_figures(wrong, trained)["first_unequal_iteration"] == 2


def _fields(m: IterationDone) -> dict[str, Any]:
    return {f: getattr(m, f) for f in m.__struct_fields__}
