import pytest

from shared.policies.packing import Candidate, Plan, layered_cost, order_key, pack

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
    room_s: float,
    *,
    memory: int = 10**9,
    max_requests: int = 32,
    order: str = "deadline",
    now: float = 0.0,
):
    return pack(
        cands,
        room_s=room_s,
        free_memory=memory,
        layers=LAYERS,
        cost=COST,
        now=now,
        max_requests=max_requests,
        order=order,
    )


def test_whole_requests_until_the_room_is_used_the_last_one_past_it() -> None:
    p = plan([cand(0, 10), cand(1, 20), cand(2, 5), cand(3, 5)], room_s=0.035)
    assert [(a.id, a.from_layer, a.to_layer) for a in p.assignments] == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 4)]
    assert planned(p) == pytest.approx(0.035)
    for room in (0.001, 0.0123, 0.05, 0.2):
        cands = [cand(i, 7 + 3 * i) for i in range(12)]
        p = plan(cands, room)
        # never short of the room while requests remain, and past it by less than the last one
        assert planned(p) >= room or len(p.assignments) == len(cands)
        assert planned(p) - p.assignments[-1].seconds < room


def test_a_request_longer_than_the_room_goes_whole_and_is_never_cut() -> None:
    p = plan([cand(0, 100), cand(1, 1)], room_s=0.025)
    assert [(a.id, a.from_layer, a.to_layer) for a in p.assignments] == [("r0", 0, LAYERS)]
    assert p.assignments[0].seconds == pytest.approx(0.100)


def test_deadline_order_then_arrival() -> None:
    cands = [cand(0, arrival=0), cand(1, deadline=9.0, arrival=1), cand(2, deadline=5.0, arrival=2), cand(3, arrival=3)]
    p = plan(cands, room_s=1.0)
    assert [a.id for a in p.assignments] == ["r2", "r1", "r0", "r3"]
    p = plan(cands, room_s=1.0, order="arrival")
    assert [a.id for a in p.assignments] == ["r0", "r1", "r2", "r3"]
    with pytest.raises(ValueError, match="unknown order"):
        order_key("random")


def test_expired_requests_are_reported_not_planned() -> None:
    p = plan([cand(0, deadline=0.5), cand(1, deadline=2.0)], room_s=1.0, now=1.0)
    assert [a.id for a in p.assignments] == ["r1"]  # r0 is past its deadline: not planned


def test_memory_limit_skips_what_does_not_fit() -> None:
    p = plan([cand(0, kv=600), cand(1, kv=600), cand(2, kv=300)], room_s=1.0, memory=1000)
    assert [a.id for a in p.assignments] == ["r0", "r2"]


def test_max_requests_and_empty_inputs() -> None:
    assert [a.id for a in plan([cand(i) for i in range(10)], 1.0, max_requests=3).assignments] == ["r0", "r1", "r2"]
    assert plan([], 1.0).assignments == ()
    assert plan([cand(0)], 0.0).assignments == ()


def test_resumed_request_is_charged_only_its_remaining_layers() -> None:
    p = plan([cand(0, 40, layer=3)], room_s=0.011)  # one layer left: 10 ms
    assert [(a.from_layer, a.to_layer) for a in p.assignments] == [(3, 4)]
