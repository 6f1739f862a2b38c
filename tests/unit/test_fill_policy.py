"""The fill policy: every timing rule the worker's fill executor obeys, on a fake clock."""

from shared.policies.fill import Arrival, FillPolicy, Held

P = FillPolicy(guard_s=0.005, hold_s=1.0)


def test_a_batch_runs_in_an_open_bubble_waits_if_staged_and_goes_back_if_late_or_redelivered() -> None:
    assert P.on_arrival(staged=False, in_bubble=True) is Arrival.RUN
    assert P.on_arrival(staged=True, in_bubble=True) is Arrival.RUN
    assert P.on_arrival(staged=True, in_bubble=False) is Arrival.HOLD
    assert P.on_arrival(staged=False, in_bubble=False) is Arrival.RETURN  # its bubble is over
    # Sent to this slot's previous process, which died holding it: back, whatever the bubble.
    for staged in (False, True):
        for in_bubble in (False, True):
            assert P.on_arrival(staged=staged, in_bubble=in_bubble, redelivered=True) is Arrival.RETURN


def test_a_bubble_shorter_than_the_guard_is_left_alone() -> None:
    assert not P.worth_filling(0.0049) and P.worth_filling(0.005) and P.worth_filling(0.2)


def test_batches_run_in_arrival_order() -> None:
    queued = [Held("a", False, 0.0), Held("b", True, 0.1)]
    assert P.next_batch(queued) == 0 and P.next_batch([]) is None


def test_a_block_starts_only_before_the_input_and_when_it_ends_in_time() -> None:
    assert P.may_start_block(input_arrived=False, now=1.0)  # nothing known: only arrival stops it
    assert not P.may_start_block(input_arrived=True, now=1.0)
    assert P.may_start_block(input_arrived=False, now=1.0, ends_at=1.010, block_s=0.010)
    assert not P.may_start_block(input_arrived=False, now=1.0, ends_at=1.010, block_s=0.0101)
    assert not P.may_start_block(input_arrived=True, now=1.0, ends_at=9.0, block_s=0.001)


def test_at_a_bubble_end_its_own_batches_go_back_and_staged_ones_stay() -> None:
    queued = [Held("for-this", False, 0.0), Held("staged", True, 0.0)]
    assert P.at_bubble_end(queued) == ["for-this"]
    assert P.at_close(queued) == ["for-this", "staged"]


def test_a_staged_batch_goes_back_when_no_bubble_takes_it_in_time() -> None:
    queued = [Held("old", True, 0.0), Held("new", True, 0.5), Held("unstaged", False, 0.0)]
    assert P.expired_holds(queued, in_bubble=False, now=0.99) == []
    assert P.expired_holds(queued, in_bubble=False, now=1.0) == ["old"]
    assert P.expired_holds(queued, in_bubble=True, now=5.0) == []  # the open bubble decides
    assert P.expired_holds(queued, in_bubble=False, now=1.5) == ["old", "new"]


def test_the_blocks_that_start_in_one_step_are_those_a_block_by_block_walk_starts() -> None:
    """The simulator asks how many blocks start at once; a worker asks before each block."""
    import random

    rng = random.Random(5)
    for _ in range(2000):
        start, block, need = rng.uniform(0, 1), rng.choice([0.0, rng.uniform(1e-4, 0.05)]), rng.randint(0, 40)
        ends_at = start + rng.uniform(-0.01, 0.5)
        walked = 0
        while walked < need and P.may_start_block(
            input_arrived=False, now=start + walked * block, ends_at=ends_at, block_s=block
        ):
            walked += 1
        if block == 0:
            walked = need  # a free block never runs the bubble out
        assert P.blocks_that_start(start=start, block_s=block, need=need, ends_at=ends_at) == walked
