"""The fill policy: a worker's queue of prefill work and every rule its fill executor obeys, on a
fake clock."""

import pytest

from shared.policies.fill import (
    BLOCK_MARGIN,
    OVERRUN_GRACE_S,
    Arrival,
    BlockTimes,
    FillQueue,
    Start,
    blocks_that_fit,
    late_on_worker,
    left_s,
    may_start,
    resume_layer,
    usable_s,
)


def test_work_queues_whether_or_not_a_bubble_is_open_and_only_a_redelivered_batch_goes_back() -> None:
    q = FillQueue(hold_s=1.0)
    assert q.arrive("a", 0.010, now=0.0) is Arrival.QUEUE  # no bubble open: it waits for one
    q.open()
    assert q.arrive("b", 0.020, now=0.1) is Arrival.QUEUE  # one open: it runs in it, after "a"
    # sent to this slot's previous process, which died holding it: back, bubble or not
    assert q.arrive("c", 0.010, now=0.1, redelivered=True) is Arrival.RETURN
    assert q.ids() == ["a", "b"] and q.queued_s == pytest.approx(0.030)


def test_a_second_copy_of_a_held_batch_is_a_duplicate_not_a_second_entry() -> None:
    """A retried XADD of the dispatcher's: the same batch id again, bubble or not."""
    q = FillQueue(hold_s=1.0)
    assert q.delivered("a") is Arrival.QUEUE
    assert q.arrive("a", 0.010, now=0.0) is Arrival.QUEUE
    assert q.delivered("a") is Arrival.DUPLICATE
    q.open()
    assert q.delivered("a", redelivered=True) is Arrival.DUPLICATE
    assert q.ids() == ["a"] and q.queued_s == pytest.approx(0.010)
    q.ran("a", finished=True)
    assert q.delivered("a") is Arrival.DUPLICATE  # run already: still a copy
    assert q.delivered("b", redelivered=True) is Arrival.RETURN


def test_a_bubble_runs_the_queue_in_arrival_order_and_nothing_runs_outside_one() -> None:
    q = FillQueue()
    q.arrive("a", 0.01, now=0.0)
    q.arrive("b", 0.01, now=0.0)
    assert q.head() is None  # no bubble
    q.open()
    assert q.head() is not None and q.head().batch_id == "a"  # type: ignore[union-attr]
    q.ran("a", finished=True)
    assert q.head().batch_id == "b"  # type: ignore[union-attr]


def test_without_a_time_or_a_prediction_only_the_training_input_stops_a_block_from_starting() -> None:
    assert may_start(input_arrived=False, block_s=None, left_s=0.001) is Start.GO
    assert may_start(input_arrived=False, block_s=0.010, left_s=None) is Start.GO
    assert may_start(input_arrived=True, block_s=None, left_s=None) is Start.INPUT


def test_an_interrupted_batch_stays_at_the_head_and_the_bubble_end_says_what_finished() -> None:
    q = FillQueue()
    for b in ("a", "b", "c"):
        q.arrive(b, 0.01, now=0.0)
    q.open()
    q.ran("a", finished=True)
    q.ran("b", finished=False, left_s=0.004)  # the input came in the middle of "b"
    assert q.close() == ("a",) and q.ids() == ["b", "c"]
    assert q.held[0].started and q.queued_s == pytest.approx(0.014)
    q.open()
    assert q.head().batch_id == "b"  # type: ignore[union-attr]
    q.ran("b", finished=True)
    assert q.close() == ("b",)  # a bubble reports only what finished in it
    with pytest.raises(KeyError):
        q.ran("zzz", finished=True)


def test_work_no_bubble_took_within_the_hold_goes_back_and_none_while_a_bubble_is_open() -> None:
    q = FillQueue(hold_s=1.0)
    q.arrive("old", 0.01, now=0.0)
    q.arrive("new", 0.01, now=0.5)
    assert q.expired(now=0.99) == []
    q.open()
    assert q.expired(now=5.0) == []  # the open bubble runs them
    q.close()
    assert q.expired(now=1.0) == ["old"] and q.ids() == ["new"]
    assert q.expired(now=1.5) == ["new"] and q.ids() == []


def test_everything_goes_back_when_the_worker_stops() -> None:
    q = FillQueue()
    q.arrive("a", 0.01, now=0.0)
    q.arrive("b", 0.01, now=0.0)
    assert q.drain() == ["a", "b"] and q.ids() == [] and q.queued_s == 0.0


def test_a_saved_state_is_resumed_only_in_its_own_datacenter() -> None:
    assert resume_layer(3, "dc-a", "dc-a") == 3 and resume_layer(3, "dc-a", "dc-b") == 0


def test_a_block_starts_only_if_it_fits_what_is_left_of_the_bubble_or_is_within_the_grace() -> None:
    """One rule for a CPU's layer and a GPU's piece (issue 63)."""
    block = 0.002  # 2 ms, the profile's or measured
    assert may_start(input_arrived=False, block_s=block, left_s=block * BLOCK_MARGIN) is Start.GO
    assert may_start(input_arrived=False, block_s=block, left_s=block * BLOCK_MARGIN * 0.99) is Start.FULL
    assert may_start(input_arrived=False, block_s=block, left_s=-0.010) is Start.FULL  # past the predicted end
    short = OVERRUN_GRACE_S / BLOCK_MARGIN  # costs training at most the grace: it starts anyway
    assert may_start(input_arrived=False, block_s=short, left_s=-0.010) is Start.GO
    assert may_start(input_arrived=False, block_s=short * 1.01, left_s=0.0) is Start.FULL
    # not measured yet, or no prediction: only the input stops it
    assert may_start(input_arrived=False, block_s=None, left_s=-1.0) is Start.GO
    assert may_start(input_arrived=False, block_s=1.0, left_s=None) is Start.GO
    # the input is here: nothing starts, however much room
    assert may_start(input_arrived=True, block_s=1e-6, left_s=10.0) is Start.INPUT


def test_a_block_fits_only_after_the_work_still_on_the_device() -> None:
    """Issue 62: the host runs a piece ahead of the device; the next piece starts on the device only
    after it, so what it must fit is what is left once that is done (before, a bubble could overrun
    by a whole piece times the margin)."""
    fits = {"input_arrived": False, "block_s": 0.002, "left_s": 0.004, "grace_s": 0.0}
    assert may_start(**fits) is Start.GO  # type: ignore[arg-type]  # 2 ms x 1.5 fits 4 ms
    assert may_start(**fits, busy_s=0.002) is Start.FULL  # type: ignore[arg-type]  # 3 ms do not fit 2 ms
    assert may_start(**fits, busy_s=0.001) is Start.GO  # type: ignore[arg-type]


def test_the_blocks_that_fit_a_bubble_stop_at_the_first_refused() -> None:
    """10 ms predicted, blocks of 3 ms, each needing 4.5 ms left (its margin): those at 0 and 3 ms
    start; at 6 ms only 4 ms is left."""
    assert blocks_that_fit(0.0, 0.010, [0.003] * 5) == 2
    assert blocks_that_fit(0.0, 0.010, [0.003, 0.003, 0.002]) == 3  # a shorter last one fits 4 ms
    assert blocks_that_fit(0.0, 0.010, [0.003, 0.008, 0.0001]) == 1  # the first refused ends it
    assert blocks_that_fit(0.0, None, [0.003] * 5) == 5  # no prediction: all
    assert blocks_that_fit(0.0, 0.0, [1e-4] * 3) == 3  # within the grace: all


def test_what_the_fit_rule_can_fill_of_a_bubble_is_what_it_starts() -> None:
    """The capacity figures count this: the blocks that start, never the rest nothing fits."""
    for bubble, block in [(0.010, 0.003), (0.0305, 0.002), (0.004, 0.003), (0.010, 0.0001), (0.0, 0.001)]:
        n = blocks_that_fit(0.0, bubble, [block] * 1000)
        assert usable_s(bubble, block) == pytest.approx(min(bubble, n * block))
    assert usable_s(0.010, 0.003) == pytest.approx(0.006)  # 2 blocks: the last 4 ms refused
    assert usable_s(0.004, 0.003) == 0.0  # not even one fits


def test_block_times_follow_the_measurements_per_token() -> None:
    t = BlockTimes(kept=4)
    assert t.predict(256, 0.0) is None
    t.observe(256, 0.256, 0.0)  # 1 ms a token
    assert t.predict(128, 0.0) == pytest.approx(0.128)
    for _ in range(3):
        t.observe(100, 0.300, 0.1)  # 3 ms a token, three times: the upper quartile of four
    assert t.predict(10, 0.1) == pytest.approx(0.030)
    t.observe(0, 1.0, 0.2)  # nothing to learn from
    t.observe(10, 0.0, 0.2)
    assert t.predict(10, 0.2) == pytest.approx(0.030)
    for _ in range(4):
        t.observe(10, 0.010, 0.3)  # 1 ms a token again: the slow ones are no longer kept
    assert t.predict(10, 0.3) == pytest.approx(0.010)


def test_one_block_a_stall_slowed_does_not_keep_the_next_out_of_the_bubble() -> None:
    """Blocks of 1 ms, then one the host stalled for 100 ms: the next still starts in a 10 ms bubble
    (a mean of them predicted 21 ms: with the margin, no block fitted, nothing measured it again,
    and a prompt cut by training input waited out its deadline, CI 2026-12-06)."""
    t = BlockTimes()
    for i in range(10):
        t.observe(5, 0.001, i * 0.01)
    t.observe(5, 0.100, 0.1)
    assert may_start(input_arrived=False, block_s=t.predict(5, 0.11), left_s=0.010) is Start.GO


def test_a_prediction_that_keeps_every_block_out_falls_back_to_the_fastest_measured() -> None:
    """A quarter of the kept blocks slow (a busy spell): the prediction refuses a 10 ms bubble; with
    no block measured for `stale_s`, the fastest kept is predicted, one block starts and is measured."""
    t = BlockTimes(kept=8, stale_s=5.0)
    for i in range(6):
        t.observe(5, 0.001, i * 0.01)
    t.observe(5, 0.100, 0.1)
    t.observe(5, 0.100, 0.2)
    assert may_start(input_arrived=False, block_s=t.predict(5, 3.0), left_s=0.010) is Start.FULL
    assert may_start(input_arrived=False, block_s=t.predict(5, 5.3), left_s=0.010) is Start.GO
    assert t.predict(5, 5.3) == pytest.approx(0.001)
    t.observe(5, 0.001, 5.3)
    assert t.predict(5, 5.4) == pytest.approx(0.100)  # fresh again: the upper quartile


def test_a_worker_fails_an_item_it_cannot_finish_before_its_prompt_is_due() -> None:
    """Due at 10.0 s: come to at 9.9 s with 50 ms of work, it runs; with 150 ms, or past 10.0 s, it
    would answer late: failed. No objective and no deadline: always run."""
    assert not late_on_worker(10.0, 9.9, 0.05)
    assert late_on_worker(10.0, 9.9, 0.15) and late_on_worker(10.0, 10.01, 0.0)
    assert not late_on_worker(None, 1e9, 1.0)


@pytest.mark.parametrize(
    ("from_layer", "to_layer", "reached", "left"),
    [(0, 24, 0, 1.2), (0, 24, 6, 0.9), (0, 24, 24, 0.0), (8, 12, 10, 0.6), (8, 12, 30, 0.0), (5, 5, 5, 0.0)],
)
def test_what_is_left_of_a_cut_item_is_the_share_of_its_layers_not_run(
    from_layer: int, to_layer: int, reached: int, left: float
) -> None:
    """1.2 s predicted for its layers: resumed at a quarter of 24 layers, 0.9 s is left; half of a
    4-layer span, 0.6 s; none past its end, or for an empty span."""
    assert left_s(1.2, from_layer, to_layer, reached) == pytest.approx(left)
