import pytest

from shared.config.spec import parse_spec
from shared.policies.pipeline_plan import placement_of
from shared.policies.placement import PlacementError, place, round_robin

PAPER_DCS = [("us-east", 128), ("us-west", 64), ("eu-west", 64)]


def test_largest_dc_first_with_consecutive_stages() -> None:
    p = place([("small", 4), ("big", 8)], pp=3, dp=2, tp=2)
    # big fits 8 // 4 = 2 stages, small 4 // 4 = 1
    assert p.stage_dc == ("big", "big", "small")
    assert p.hops() == [(1, "big", "small")]
    assert p.gpus_used() == {"big": 8, "small": 4}


def test_ties_broken_by_name_and_single_dc() -> None:
    assert place([("b", 4), ("a", 4)], pp=2, dp=4, tp=1).stage_dc == ("a", "b")  # one stage per DC
    p = place([("only", 16)], pp=4, dp=2, tp=2)
    assert p.stage_dc == ("only",) * 4 and p.hops() == []


def test_remainders_are_not_combined_across_dcs() -> None:
    # each DC has 3 GPUs; a stage needs 2 in one DC: one stage per DC, the odd GPUs stay idle
    assert place([("a", 3), ("b", 3)], pp=2, dp=2, tp=1).stage_dc == ("a", "b")
    with pytest.raises(PlacementError, match="fit only 2; 1 more stage\\(s\\) need 2 more GPUs"):
        place([("a", 3), ("b", 3)], pp=3, dp=2, tp=1)


def test_every_stage_placed_exactly_once_over_many_shapes() -> None:
    for gpus in ([8], [8, 4], [5, 7, 3], [16, 16, 2]):
        dcs = [(f"dc{i}", g) for i, g in enumerate(gpus)]
        for dp in (1, 2):
            for tp in (1, 2):
                cap = sum(g // (dp * tp) for g in gpus)
                for pp in range(1, cap + 1):
                    p = place(dcs, pp, dp, tp)
                    assert p.stages == pp
                    for dc, used in p.gpus_used().items():
                        assert used <= dict(dcs)[dc]
                    # consecutive: each DC's stages form one contiguous run
                    runs = [dc for i, dc in enumerate(p.stage_dc) if i == 0 or p.stage_dc[i - 1] != dc]
                    assert len(runs) == len(set(runs))
                with pytest.raises(PlacementError):
                    place(dcs, cap + 1, dp, tp)


def test_bad_degrees() -> None:
    with pytest.raises(PlacementError, match="at least 1"):
        place([("a", 4)], pp=0, dp=1, tp=1)


def test_round_robin_deals_stages_in_spec_order_so_every_hop_crosses_the_wan() -> None:
    p = round_robin([("b", 8), ("a", 8)], pp=4, dp=2, tp=2)
    assert p.stage_dc == ("b", "a", "b", "a")  # spec order, not sorted: stage k in DC k mod 2
    assert p.hops() == [(0, "b", "a"), (1, "a", "b"), (2, "b", "a")]
    assert p.gpus_used() == {"b": 8, "a": 8}
    assert place([("b", 8), ("a", 8)], pp=4, dp=2, tp=2).hops() == [(1, "a", "b")]


def test_round_robin_skips_a_full_dc_on_the_paper_cluster() -> None:
    # 32 GPUs a stage: us-east holds 4 stages, the others 2 each; the deal runs out of room in the small DCs
    rr = round_robin(PAPER_DCS, pp=8, dp=4, tp=8)
    assert rr.stage_dc == ("us-east", "us-west", "eu-west", "us-east", "us-west", "eu-west", "us-east", "us-east")
    assert len(rr.hops()) == 6
    assert len(place(PAPER_DCS, pp=8, dp=4, tp=8).hops()) == 2
    # each directed link carries two of the six hops
    links = [(a, b) for _, a, b in rr.hops()]
    assert {link: links.count(link) for link in links} == {
        ("us-east", "us-west"): 2,
        ("us-west", "eu-west"): 2,
        ("eu-west", "us-east"): 2,
    }


def test_round_robin_is_feasible_exactly_when_atlas_is() -> None:
    for gpus in ([8], [8, 4], [5, 7, 3], [16, 16, 2]):
        dcs = [(f"dc{i}", g) for i, g in enumerate(gpus)]
        for dp in (1, 2):
            for tp in (1, 2):
                cap = sum(g // (dp * tp) for g in gpus)
                for pp in range(1, cap + 1):
                    p = round_robin(dcs, pp, dp, tp)
                    assert p.stages == pp and (p.dp, p.tp) == (dp, tp)
                    for dc, used in p.gpus_used().items():
                        assert used <= dict(dcs)[dc]
                    # never fewer hops than Atlas's consecutive placement
                    assert len(p.hops()) >= len(place(dcs, pp, dp, tp).hops())
                with pytest.raises(PlacementError):
                    round_robin(dcs, cap + 1, dp, tp)


def test_round_robin_infeasible_names_the_gpus_missing_in_each_dc() -> None:
    # 32 GPUs a stage: a holds 4, b 1, c 1; the deal ends on a, so the 2 stages left go to b and c,
    # which have 8 and 18 GPUs to spare: they lack 24 and 14
    with pytest.raises(PlacementError) as err:
        round_robin([("a", 130), ("b", 40), ("c", 50)], pp=8, dp=4, tp=8)
    msg = str(err.value)
    assert "cannot place 8 pipeline stages round-robin, 32 GPUs each (DP=4 x TP=8" in msg
    assert "a=130 holds 4, b=40 holds 1, c=50 holds 1, 6 in all" in msg
    assert msg.endswith("need 24 more GPUs in b (1 stage(s)), 14 more GPUs in c (1 stage(s))")
    with pytest.raises(PlacementError, match=r"the other 2 stage\(s\), dealt on in turn, need 8 more GPUs in a"):
        round_robin([("a", 8)], pp=4, dp=2, tp=2)  # one DC: both missing stages go there
    with pytest.raises(PlacementError, match="at least 1"):
        round_robin([("a", 4)], pp=1, dp=0, tp=1)
    with pytest.raises(PlacementError, match="no datacenters"):
        round_robin([], pp=1, dp=1, tp=1)


def test_the_spec_picks_the_placement() -> None:
    raw = {"datacenters": [{"name": n, "gpus": g} for n, g in PAPER_DCS], "model": {"layers": 8}}
    atlas = parse_spec({**raw, "parallelism": {"pp": 8, "dp": 4, "tp": 8}})
    assert atlas.parallelism.placement == "atlas"
    assert placement_of(atlas) == place(PAPER_DCS, 8, 4, 8)
    rr = parse_spec({**raw, "parallelism": {"pp": 8, "dp": 4, "tp": 8, "placement": "round_robin"}})
    assert placement_of(rr) == round_robin(PAPER_DCS, 8, 4, 8)
