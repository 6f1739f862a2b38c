import random

import pytest

from shared.config.spec import parse_spec
from shared.policies.prefill_cost import PrefillCostModel, PrefillProfile


def test_learns_a_quadratic_cost_from_reports() -> None:
    truth = lambda t: 0.001 + 2e-5 * t + 1e-8 * t * t  # noqa: E731
    m = PrefillCostModel()
    rng = random.Random(0)
    for _ in range(300):
        t = rng.randint(8, 1024)
        m.observe(t, truth(t) * rng.uniform(0.97, 1.03))
    for t in (16, 256, 1000):
        assert m.predict(t) == pytest.approx(truth(t), rel=0.05)
    assert m.reports == 300


def test_adapts_when_the_device_changes() -> None:
    m = PrefillCostModel()
    for _ in range(100):
        m.observe(100, 0.010)
    for _ in range(200):
        m.observe(100, 0.020)  # the device got slower (e.g. contention)
    assert m.predict(100) == pytest.approx(0.020, rel=0.05)


def test_prior_gives_sane_predictions_and_bad_reports_are_ignored() -> None:
    m = PrefillCostModel()
    assert 0 < m.predict(16) < m.predict(512)
    before = m.predict(100)
    m.observe(0, 1.0)
    m.observe(100, float("nan"))
    m.observe(100, -1.0)
    assert m.predict(100) == before and m.reports == 0


def test_a_profile_from_the_spec_has_its_overheads_and_pieces_where_a_worker_runs_them() -> None:
    base = {
        "datacenters": [{"name": "a", "gpus": 2}],
        "model": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
        "parallelism": {"pp": 2, "dp": 1},
    }
    overheads = {"prefill_launch_us": 300.0, "prefill_sync_us": 50.0}
    spec = parse_spec({**base, "device": {"prefill_ms_per_layer": 0.2, "prefill_us_per_token": 4.0, **overheads}})
    cpu, gpu = PrefillProfile.of_spec(spec), PrefillProfile.of_spec(spec, on_gpu=True)
    assert cpu is not None and gpu is not None
    assert (cpu.launch_s, cpu.sync_s, cpu.piece_tokens, gpu.piece_tokens) == (
        pytest.approx(3e-4),
        pytest.approx(5e-5),
        None,  # whole layers on a CPU (bubbletea.piece_tokens 0: automatic)
        256,
    )
    assert cpu.block_s(1) == pytest.approx(3e-4)  # the launch floor
    assert cpu.block_s(100) == pytest.approx(6e-4)
    assert gpu.pieces(600) == [256, 256, 88] and cpu.pieces(600) == [600]
    # no prefill profile: real compute time, whatever the overheads say
    assert PrefillProfile.of_spec(parse_spec({**base, "device": overheads})) is None


def test_a_layers_pieces_and_time_are_the_blocks_one_by_one() -> None:
    """`pieces` and `layer_s` (on the simulator's hot path, written out) are the straightforward
    ones: blocks of `piece_tokens` from the prompt's start, their times summed in order."""
    rng = random.Random(3)
    for _ in range(300):
        size = rng.choice([None, 1, 7, 64, 256])
        p = PrefillProfile(rng.random() * 1e-3, rng.random() * 1e-5, rng.choice([0.0, 2e-4]), 1e-5, size)
        tokens = rng.randint(1, 3000)
        pieces = [tokens] if size is None else [min(size, tokens - s) for s in range(0, tokens, size)]
        assert p.pieces(tokens) == pieces
        assert p.layer_s(tokens) == sum(p.block_s(n) for n in pieces)  # exactly
