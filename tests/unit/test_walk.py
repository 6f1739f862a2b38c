"""The one schedule walker: every action of the schedule in order, the walk's own steps, the tensors named."""

from __future__ import annotations

import pytest

from shared.policies.schedules import Op, schedule
from shared.policies.walk import COLLECTIVES, END, SlotWalk, Step, has_step_collectives


def _walk(walk: SlotWalk, limit: int = 10_000) -> list[tuple[int, int, Step]]:
    """(iteration, position, step) of every step until the walk ends."""
    out = []
    while (a := walk.current()) is not None and len(out) < limit:
        out.append((walk.iteration, walk.pos, a))
        walk.advance()
    return out


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stage", "stages", "mbs"), [(0, 1, 1), (0, 4, 3), (2, 4, 3), (3, 4, 8)])
def test_the_walk_is_the_schedule_then_end_each_iteration(name: str, stage: int, stages: int, mbs: int) -> None:
    acts = schedule(name, stage, stages, mbs)
    steps = _walk(SlotWalk(1, stage, acts, iterations=2))
    assert [a for _, _, a in steps] == [*acts, END, *acts, END]
    assert [it for it, _, _ in steps] == [0] * (len(acts) + 1) + [1] * (len(acts) + 1)
    assert [pos for _, pos, a in steps if a is not END] == list(range(len(acts))) * 2


def test_collectives_come_before_the_step_at_its_position() -> None:
    acts = schedule("1f1b", 1, 2, 2)
    step_pos = [a.op for a in acts].index(Op.STEP)
    steps = _walk(SlotWalk(0, 1, acts, iterations=1, collectives=True))
    assert [(pos, a) for _, pos, a in steps][step_pos : step_pos + 3] == [
        (step_pos, COLLECTIVES),
        (step_pos, acts[step_pos]),
        (len(acts), END),
    ]


def test_a_resumed_walk_starts_at_its_iteration_and_an_endless_one_goes_on() -> None:
    acts = schedule("gpipe", 0, 2, 1)
    assert {it for it, _, _ in _walk(SlotWalk(0, 0, acts, iterations=7, start=5))} == {5, 6}
    endless = _walk(SlotWalk(0, 0, acts), limit=10 * (len(acts) + 1))
    assert endless[-1][0] == 9 and endless[-1][2] is END


def test_sends_and_receives_name_the_tensor_as_its_receiver_does() -> None:
    """What stage k sends to k + 1 (its activation) is what k + 1 awaits; the gradient back the same."""
    stages, mbs = 3, 2
    walks = [SlotWalk(1, k, schedule("1f1b", k, stages, mbs), iterations=2) for k in range(stages)]
    sent: list[tuple[int, int, str, int, int]] = []
    awaited: list[tuple[int, int, str, int, int]] = []
    for w in walks:
        while (a := w.current()) is not None:
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                sent.append(w.sent())
            elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                awaited.append(w.awaited())
            w.advance()
    assert sorted(sent) == sorted(awaited)
    assert (1, 1, "act", 1, 0) in awaited and (1, 0, "grad", 0, 1) in awaited


@pytest.mark.parametrize(
    ("stages", "clip", "tied", "expected"),
    [(1, 1.0, True, False), (2, 0.0, False, False), (2, 1.0, False, True), (2, 0.0, True, True)],
)
def test_the_step_has_collectives_with_stages_and_a_global_norm_or_a_tied_embedding(
    stages: int, clip: float, tied: bool, expected: bool
) -> None:
    assert has_step_collectives(stages, clip, tied) is expected
