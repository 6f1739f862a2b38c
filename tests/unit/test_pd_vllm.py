"""bench/pd_vllm.py's pure pieces: the seeded schedule both arms share, and the figures, in which
every request sent counts and a failed one never enters a latency percentile."""

from __future__ import annotations

import argparse

import pytest

from bench import pd_vllm
from bench.lib import pd_load
from bench.lib.pd_load import Outcome


def test_the_schedule_is_seeded_poisson_within_the_duration() -> None:
    times = pd_vllm.arrivals(2.0, 600.0, seed=5)
    assert times == pd_vllm.arrivals(2.0, 600.0, seed=5)  # both arms get the same times
    assert times != pd_vllm.arrivals(2.0, 600.0, seed=6)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 600
    assert len(times) == pytest.approx(1200, rel=0.1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.1)  # exponential gaps of mean 1/rate
    assert pd_vllm.arrivals(0, 10, seed=1) == [] and pd_vllm.arrivals(1, 0, seed=1) == []


def test_prompts_are_seeded_never_end_of_sequence_and_within_their_lengths() -> None:
    ps = pd_vllm.prompts(200, 16, 200, seed=7)
    assert ps == pd_vllm.prompts(200, 16, 200, seed=7)
    assert all(16 <= len(p) <= 200 for p in ps)
    assert min(len(p) for p in ps) < 40 and max(len(p) for p in ps) > 170
    assert all(1 <= t <= 999 for p in ps for t in p)


def ok(ttft: float, e2e: float, tokens: int = 16) -> Outcome:
    return Outcome(ttft_s=ttft, second_s=ttft + 0.01, e2e_s=e2e, tokens=tokens)


def test_time_per_output_token_is_the_decode_time_over_the_tokens_after_the_first() -> None:
    assert ok(0.1, 1.6).tpot_s == pytest.approx(0.1)
    assert Outcome(failed="timeout").tpot_s is None
    assert ok(0.1, 0.2, tokens=1).tpot_s is None


def test_text_is_what_a_reader_sees_not_pieces_of_unfinished_characters() -> None:
    assert pd_load.visible("a") and pd_load.visible(" ") and pd_load.visible("\ufffdb")
    assert not pd_load.visible("") and not pd_load.visible("\ufffd\ufffd") and not pd_load.visible(None)


def test_every_request_sent_counts_and_failed_ones_stay_out_of_the_percentiles() -> None:
    outcomes = [ok(0.1 * (i + 1), 2.0) for i in range(10)]
    outcomes += [Outcome(failed="http_503"), Outcome(failed="timeout"), Outcome(failed="http_503", ttft_s=0.001)]
    outcomes.append(Outcome(e2e_s=2.0, tokens=16))  # answered, every token part of an unfinished character
    s = pd_vllm.summary(outcomes)
    assert (s["answered"], s["answered_without_text"], s["sent"]) == (11, 1, 14)
    assert s["failed"] == {"http_503": 2, "timeout": 1}
    assert s["ttft_p50_ms"] == pytest.approx(550.0)  # over the ten answered: 0.1 .. 1.0 s
    assert s["ttft_p99_ms"] == pytest.approx(991.0)
    assert s["e2e_p99_ms"] == pytest.approx(2000.0)
    empty = pd_vllm.summary([Outcome(failed="connection")])
    assert empty["ttft_p50_ms"] is None and empty["answered"] == 0 and empty["sent"] == 1


def test_ratios_are_bubbletea_over_vllm_alone_and_medians_over_pairs() -> None:
    alone = pd_vllm.summary([ok(0.1, 1.6)])
    ours = pd_vllm.summary([ok(0.3, 2.1)])
    r = pd_vllm.ratios(alone, ours)
    assert r["ttft_p50_ratio"] == pytest.approx(3.0)
    assert r["tpot_p50_ratio"] == pytest.approx(1.2)
    assert pd_vllm.ratios(alone, pd_vllm.summary([Outcome(failed="timeout")]))["ttft_p50_ratio"] is None
    assert pd_vllm.median_of([3.0, None, 1.0, 2.0]) == 2.0 and pd_vllm.median_of([None]) is None


def test_the_time_scale_is_read_from_what_up_printed_or_none() -> None:
    log = "==> redis\n==> device time scale 6.3 (worst op ...; 4 processes at once)\n==> started x"
    assert pd_vllm.time_scale(log) == 6.3
    assert pd_vllm.time_scale("==> device time scale 1 (BUBBLETEA_TIME_SCALE)") == 1.0
    assert pd_vllm.time_scale("==> started x") is None


def test_the_json_line_pools_requests_and_names_each_figure() -> None:
    args = argparse.Namespace(rate=2.0, duration=20.0, prompt_min=16, prompt_max=200, max_tokens=16)
    pairs = []
    pooled: dict[str, list[Outcome]] = {a: [] for a in pd_vllm.ARMS}
    for share in (1.0, 0.9):
        a, b = [ok(0.1, 1.6)], [ok(0.4, 2.0), Outcome(failed="timeout")]
        pooled["vllm_alone"] += a
        pooled["bubbletea_vllm"] += b
        pair = {"sent": 2, **pd_vllm.ratios(pd_vllm.summary(a), pd_vllm.summary(b))}
        pair |= {"prefill_tokens_off_vllm_share": share, "vllm_local_compute_per_request": 1.0}
        pair |= {"vllm_alone_local_share": 1.0, "bubble_queue_mean_ms": 30.0, "bubble_prefill_mean_ms": 5.0}
        pairs.append(pair)
    res = pd_vllm.result(pairs, pooled, k=5.0, args=args)
    assert res["bench"] == "pd_vllm" and res["clock"] == "host wall" and res["time_scale"] == 5.0
    assert res["vllm_alone"]["answered"] == 2 and res["bubbletea_vllm"]["failed"] == {"timeout": 2}
    assert res["ttft_p50_ratio"] == pytest.approx(4.0)
    assert res["prefill_tokens_off_vllm_share"] == pytest.approx(0.95)
    assert len(res["pairs"]) == 2 and res["sent_per_arm"] == 2


def test_the_sweep_counts_every_request_sent_in_its_attainment_and_goodput() -> None:
    from bench.lib import pd_sweep

    fast = Outcome(ttft_s=0.1, second_s=0.11, e2e_s=0.25, tokens=16)  # TPOT 10 ms
    slow_tokens = Outcome(ttft_s=0.1, second_s=0.3, e2e_s=3.1, tokens=16)  # TPOT 200 ms
    late = Outcome(ttft_s=0.7, second_s=0.71, e2e_s=0.85, tokens=16)
    outcomes = [fast, fast, slow_tokens, late, Outcome(failed="http_429")]
    assert pd_sweep.attainment(outcomes, 0.5) == 0.6  # 3 of 5 sent: the 429 and the late one miss
    assert pd_sweep.goodput_rps(outcomes, 0.5, 0.1, duration_s=2.0) == 1.0  # 2 meet both, over 2 s
    assert pd_sweep.attainment([], 0.5) is None


def test_the_sweep_verdicts_are_the_issues_targets() -> None:
    from bench.lib import pd_sweep

    def arm(slo: float, p99: float | None, failed: dict[str, int]) -> dict[str, object]:
        return {"slo_attainment": slo, "ttft_p99_ms": p99, "failed": failed}

    light = {"vllm_alone": arm(1.0, 80.0, {}), "bubbletea_vllm": arm(0.995, 450.0, {})}
    heavy = {"vllm_alone": arm(0.6, 900.0, {}), "bubbletea_vllm": arm(0.7, 800.0, {"http_429": 30})}
    v = pd_sweep.verdicts([light, heavy], 500.0)
    assert v == {
        "slo_attainment_within_0_01_everywhere": True,
        "ttft_p99_within_objective_where_vllm_alone_is": True,
        "no_429_where_vllm_alone_meets_objective": True,  # the 429s came where vLLM alone missed it too
        "failed_other_than_429": 0,
    }
    light["bubbletea_vllm"] = arm(0.98, 520.0, {"http_429": 1, "timeout": 2})
    v = pd_sweep.verdicts([light, heavy], 500.0)
    assert not any(v[k] for k in list(v)[:3]) and v["failed_other_than_429"] == 2


def test_a_verdict_no_point_qualifies_for_is_null_not_true() -> None:
    """Issue 62: where vLLM alone never meets the objective, "p99 within the objective where vLLM
    alone is" and "no 429 there" held vacuously; they are None."""
    from bench.lib import pd_sweep

    heavy = {
        "vllm_alone": {"slo_attainment": 0.5, "ttft_p99_ms": 900.0, "failed": {}},
        "bubbletea_vllm": {"slo_attainment": 0.5, "ttft_p99_ms": 950.0, "failed": {"http_429": 3}},
    }
    v = pd_sweep.verdicts([heavy], 500.0)
    assert v["ttft_p99_within_objective_where_vllm_alone_is"] is None
    assert v["no_429_where_vllm_alone_meets_objective"] is None
    assert v["slo_attainment_within_0_01_everywhere"] is True
    assert pd_sweep.verdicts([], 500.0)["slo_attainment_within_0_01_everywhere"] is None
