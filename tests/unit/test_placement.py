import pytest

from shared.policies.placement import PlacementError, place


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
