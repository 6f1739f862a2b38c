import pytest

from shared.policies.packing import Candidate, Plan, budget, layered_cost, order_key, pack

LAYERS = 4


def planned(p: Plan) -> float:
    return sum(a.seconds for a in p.assignments)


def linear(tokens: int) -> float:
    return tokens * 0.001  # 1 ms per token for a whole prompt


COST = layered_cost(linear, LAYERS)


def cand(
    i: int,
    tokens: int = 10,
    *,
    deadline: float | None = None,
    arrival: float | None = None,
    layer: int = 0,
    kv: int = 100,
) -> Candidate:
    return Candidate(
        id=f"r{i}",
        tokens=tokens,
        next_layer=layer,
        arrival=float(i if arrival is None else arrival),
        kv_bytes=kv,
        deadline=deadline,
    )


def plan(
    cands: list[Candidate],
    budget_s: float,
    *,
    memory: int = 10**9,
    max_requests: int = 32,
    order: str = "deadline",
    now: float = 0.0,
):
    return pack(
        cands,
        budget_s=budget_s,
        free_memory=memory,
        layers=LAYERS,
        cost=COST,
        now=now,
        max_requests=max_requests,
        order=order,
    )


def test_fits_whole_requests_and_never_exceeds_budget() -> None:
    p = plan([cand(0, 10), cand(1, 20), cand(2, 5)], budget_s=0.035)
    assert [(a.id, a.from_layer, a.to_layer) for a in p.assignments] == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 4)]
    assert planned(p) == pytest.approx(0.035)
    for b in (0.0, 0.001, 0.0123, 0.05, 0.2):
        cands = [cand(i, 7 + 3 * i) for i in range(12)]
        assert planned(plan(cands, b)) <= b + 1e-12


def test_head_that_does_not_fit_runs_whole_layers_and_is_not_overtaken() -> None:
    # r0 needs 40 ms; 25 ms fits 2 of its 4 layers (10 ms each); r1 (tiny) must not jump ahead
    p = plan([cand(0, 40), cand(1, 1)], budget_s=0.025)
    assert [(a.id, a.from_layer, a.to_layer) for a in p.assignments] == [("r0", 0, 2)]
    assert p.assignments[0].seconds == pytest.approx(0.020)


def test_request_longer_than_any_bubble_completes_across_bubbles() -> None:
    c = cand(0, 100)  # 100 ms, bubbles of 30 ms
    done_at = None
    for bubble in range(10):
        p = plan([c], budget_s=0.030)
        (a,) = p.assignments
        assert a.from_layer == c.next_layer and a.to_layer > a.from_layer  # progress every bubble
        c = Candidate(c.id, c.tokens, a.to_layer, c.arrival, c.kv_bytes)
        if c.next_layer == LAYERS:
            done_at = bubble
            break
    assert done_at == 3  # 25 ms per layer, one layer per 30 ms bubble


def test_deadline_order_then_arrival() -> None:
    cands = [cand(0, arrival=0), cand(1, deadline=9.0, arrival=1), cand(2, deadline=5.0, arrival=2), cand(3, arrival=3)]
    p = plan(cands, budget_s=1.0)
    assert [a.id for a in p.assignments] == ["r2", "r1", "r0", "r3"]
    p = plan(cands, budget_s=1.0, order="arrival")
    assert [a.id for a in p.assignments] == ["r0", "r1", "r2", "r3"]
    with pytest.raises(ValueError, match="unknown order"):
        order_key("random")


def test_expired_requests_are_reported_not_planned() -> None:
    p = plan([cand(0, deadline=0.5), cand(1, deadline=2.0)], budget_s=1.0, now=1.0)
    assert [a.id for a in p.assignments] == ["r1"]  # r0 is past its deadline: not planned


def test_memory_limit_skips_what_does_not_fit() -> None:
    p = plan([cand(0, kv=600), cand(1, kv=600), cand(2, kv=300)], budget_s=1.0, memory=1000)
    assert [a.id for a in p.assignments] == ["r0", "r2"]


def test_max_requests_and_empty_inputs() -> None:
    assert [a.id for a in plan([cand(i) for i in range(10)], 1.0, max_requests=3).assignments] == ["r0", "r1", "r2"]
    assert plan([], 1.0).assignments == ()
    assert plan([cand(0)], 0.0).assignments == ()


def test_resumed_request_is_charged_only_its_remaining_layers() -> None:
    p = plan([cand(0, 40, layer=3)], budget_s=0.011)  # one layer left: 10 ms
    assert [(a.from_layer, a.to_layer) for a in p.assignments] == [(3, 4)]


def test_budget() -> None:
    assert budget(0.050, elapsed_s=0.001, guard_s=0.002, overhead_s=0.001) == pytest.approx(0.046)
    assert budget(0.002, elapsed_s=0.0, guard_s=0.002, overhead_s=0.001) == 0.0


def test_with_requests_waiting_the_bubble_is_filled_to_within_one_layer() -> None:
    import random

    rng = random.Random(1)
    for _ in range(200):
        cands = [cand(i, rng.randint(5, 400), layer=rng.choice([0, 0, 0, 2])) for i in range(40)]
        b = rng.uniform(0.005, 0.5)
        p = plan(cands, b)
        head_layer_cost = max(COST(c.tokens, 0, 1) for c in cands)
        assert planned(p) <= b + 1e-12
        assert b - planned(p) < head_layer_cost  # never leaves a whole layer's time unused
