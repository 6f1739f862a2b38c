from shared.policies.bubbles import BubblePredictor


def test_prior_before_history_then_shortest_recent() -> None:
    p = BubblePredictor(prior={3: 0.010})
    assert p.predict(3) == 0.010 and p.predict(7) == 0.0
    p.observe(3, 0.010, 0.012)
    p.observe(3, 0.012, 0.009)
    assert p.predict(3) == 0.009  # conservative: the shortest seen
    for actual in (0.02, 0.02, 0.02, 0.02):
        p.observe(3, p.predict(3), actual)
    assert p.predict(3) == 0.02  # old short ones age out of the window
    # the first was under-predicted, the second over: 1 of 6 (the later four were exact or under)
    assert p.observed == 6 and p.over_predicted == 1
    assert p.over_predicted_share() == 1 / 6


def test_warm_up_bubbles_do_not_pin_the_prediction() -> None:
    p = BubblePredictor(prior={0: 0.100})
    p.observe(0, 0.100, 0.0015, iteration=0)  # start-up: a short first bubble
    assert p.predict(0) == 0.100  # still the analytic prior, not the warm-up outlier
    p.observe(0, 0.100, 0.120, iteration=1)
    assert p.predict(0) == 0.120
    assert p.observed == 2 and p.over_predicted == 1  # the warm-up bubble still counts in the record


def test_a_position_without_a_prior_is_predicted_from_its_warm_up_bubble_until_it_has_history() -> None:
    """The step's wait for the pipeline's collectives: the analytic model has no prior for it."""
    p = BubblePredictor(prior={0: 0.100})
    p.observe(9, 0.0, 0.370, iteration=0)
    assert p.predict(9) == 0.370  # not 0: the first steady iteration's step bubble gets filled
    p.observe(0, 0.100, 0.0015, iteration=0)
    assert p.predict(0) == 0.100  # where a prior exists it still wins over the warm-up
    p.observe(9, 0.370, 0.380, iteration=1)
    p.observe(9, 0.380, 0.375, iteration=2)
    assert p.predict(9) == 0.375  # history replaces it, and it never enters the history


def test_the_typical_bubble_is_the_median_of_the_predictions_by_position() -> None:
    p = BubblePredictor(prior={0: 0.010, 3: 0.050, 5: 0.002})
    assert p.typical() == 0.010
    p.observe(3, 0.050, 0.004, iteration=1)  # position 3 now predicts 4 ms
    p.observe(7, 0.0, 0.030, iteration=1)  # a position the model had not predicted
    assert p.typical() == 0.010  # of 2, 4, 10, 30 ms: the upper middle, as the dispatcher takes it
    assert BubblePredictor().typical() == 0.0


def test_the_fit_rules_room_is_0_where_the_model_expects_no_bubble_and_unknown_without_a_model() -> None:
    """Issue 63: a position the analytic model gives no bubble (a bus hop's wait) gets room 0, so
    only blocks within the grace start; with no model at all nothing is known (None: only the input
    stops prefill); a warm-up bubble or history makes it known."""
    p = BubblePredictor(prior={0: 0.100})
    assert p.room(0) == 0.100 and p.room(8) == 0.0
    p.observe(8, 0.0, 0.0006, iteration=0)
    assert p.room(8) == 0.0006  # its warm-up bubble: known now
    blind = BubblePredictor()
    assert blind.room(0) is None
    blind.observe(0, 0.0, 0.050, iteration=1)
    assert blind.room(0) == 0.050
