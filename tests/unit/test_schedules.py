"""Property tests of the schedules over many (PP, microbatches) pairs."""

from collections import Counter

import pytest

from shared.policies.schedules import SCHEDULES, Action, Op, compute_bubble_fraction, schedule

PAIRS = [(p, m) for p in range(1, 9) for m in range(1, 17)]


def run_to_completion(name: str, p: int, m: int) -> list[list[Action]]:
    """Execute every stage's list with blocking receives and buffered sends; fail on deadlock."""
    lists = [list(schedule(name, k, p, m)) for k in range(p)]
    pos = [0] * p
    sent: set[tuple[Op, int, int]] = set()  # (kind, microbatch, receiving stage)
    done: list[list[Action]] = [[] for _ in range(p)]
    while any(pos[k] < len(lists[k]) for k in range(p)):
        progressed = False
        for k in range(p):
            while pos[k] < len(lists[k]):
                a = lists[k][pos[k]]
                if a.op is Op.RECV_ACT and (Op.SEND_ACT, a.mb, k) not in sent:
                    break
                if a.op is Op.RECV_GRAD and (Op.SEND_GRAD, a.mb, k) not in sent:
                    break
                if a.op is Op.SEND_ACT:
                    sent.add((Op.SEND_ACT, a.mb, k + 1))
                if a.op is Op.SEND_GRAD:
                    sent.add((Op.SEND_GRAD, a.mb, k - 1))
                done[k].append(a)
                pos[k] += 1
                progressed = True
        assert progressed, f"{name} deadlocks for p={p}, m={m} at {[str(lists[k][pos[k]]) for k in range(p)]}"
    return done


@pytest.mark.parametrize("name", SCHEDULES)
def test_no_deadlock_and_well_formed(name: str) -> None:
    for p, m in PAIRS:
        done = run_to_completion(name, p, m)
        for k, acts in enumerate(done):
            ops = Counter(a.op for a in acts)
            assert ops[Op.FWD] == ops[Op.BWD] == m
            assert ops[Op.SEND_ACT] == (m if k < p - 1 else 0) and ops[Op.RECV_ACT] == (m if k > 0 else 0)
            assert ops[Op.SEND_GRAD] == (m if k > 0 else 0) and ops[Op.RECV_GRAD] == (m if k < p - 1 else 0)
            assert acts[-2:] == [Action(Op.ALLREDUCE), Action(Op.STEP)]
            index = {a: i for i, a in enumerate(acts)}
            for mb in range(m):
                assert index[Action(Op.FWD, mb)] < index[Action(Op.BWD, mb)], "forward before backward"
                if k < p - 1:
                    assert index[Action(Op.FWD, mb)] < index[Action(Op.SEND_ACT, mb)]
                    assert index[Action(Op.RECV_GRAD, mb)] < index[Action(Op.BWD, mb)]
                if k > 0:
                    assert index[Action(Op.RECV_ACT, mb)] < index[Action(Op.FWD, mb)]
                    assert index[Action(Op.BWD, mb)] < index[Action(Op.SEND_GRAD, mb)]


def test_1f1b_bounds_live_activations() -> None:
    for p, m in PAIRS:
        for k in range(p):
            live = peak = 0
            for a in schedule("1f1b", k, p, m):
                live += a.op is Op.FWD
                live -= a.op is Op.BWD
                peak = max(peak, live)
            assert peak == min(p - k, m)  # GPipe would hold all m


def test_bubble_formula() -> None:
    assert compute_bubble_fraction(1, 8) == 0
    assert compute_bubble_fraction(4, 4) == 3 / 7


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule("zigzag", 0, 2, 2)
    with pytest.raises(ValueError, match="no stage 2"):
        schedule("gpipe", 2, 2, 2)
