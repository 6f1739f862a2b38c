"""The load generator's pure parts: arrivals, datasets, trace parsing, the summary and the result
JSON (vLLM's keys), reading an event stream, and the CLI (vLLM's flag names and loadgen's own)."""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from loadgen import arrivals, datasets, report, result
from loadgen.cli import BenchmarkConfig, Request, Workload, build_workload, drive, main, parse_config, warm_up
from loadgen.client import normalize_base_url, poll_delays
from loadgen.outcome import Outcome, RequestFailed, error_message
from loadgen.stream import StreamTally, server_ttft_s, sse_data

# --- arrivals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_rate_and_burstiness_statistics(burstiness: float) -> None:
    rate = 10.0
    gaps = arrivals.interval_array(20_000, rate, burstiness, np.random.default_rng(0))
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.03)
    # A gamma with shape k has a coefficient of variation of 1/sqrt(k): 1 is Poisson, below is burstier.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert not arrivals.interval_array(50, math.inf, 1.0, np.random.default_rng(0)).any()
    offsets = arrivals.arrival_offsets(math.inf, 0.5, np.random.default_rng(0))
    assert [next(offsets) for _ in range(5)] == [0.0] * 5


def test_arrival_offsets_accumulate_the_intervals_and_are_seeded() -> None:
    gaps = arrivals.interval_array(4, 5.0, 1.0, np.random.default_rng(7))
    offsets = arrivals.arrival_offsets(5.0, 1.0, np.random.default_rng(7))
    got = [next(offsets) for _ in range(5)]
    assert got == pytest.approx([0.0, *np.cumsum(gaps).tolist()])  # the first request goes at once


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, -2)])
def test_arrival_parameters_are_checked(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrivals.validate(rate, burstiness)


# --- random prompts ----------------------------------------------------------------------------


def test_length_range_is_vllms() -> None:
    # vLLM's random dataset: [floor(len * (1 - r)), ceil(len * (1 + r))], 0 <= r < 1.
    assert datasets.length_range(128, 0.0) == (128, 128)
    assert datasets.length_range(128, 0.5) == (64, 192)
    assert datasets.length_range(96, 0.33) == (64, 128)  # floor(64.32), ceil(127.68)
    assert datasets.length_range(2, 0.9) == (1, 4)  # never below one token (vLLM would refuse 0)
    for bad in [(0, 0.0), (10, 1.0), (10, -0.1)]:
        with pytest.raises(ValueError):
            datasets.length_range(*bad)


def test_output_lengths_are_drawn_like_vllms_and_1_stays_1() -> None:
    assert datasets.output_range(128, 0.5) == (64, 192)  # vLLM's range, as for the prompts
    assert datasets.output_range(2, 0.9) == (1, 4)  # at least one token (vLLM raises its low end to 1 too)
    assert datasets.output_range(1, 0.5) == (1, 1)  # the default: prefill only, whatever the ratio
    with pytest.raises(ValueError, match="output length must be >= 1"):
        datasets.output_range(0, 0.0)
    lens = datasets.random_output_lens(100, 0.25, np.random.default_rng(0))
    drawn = [next(lens) for _ in range(400)]
    assert min(drawn) == 75 and max(drawn) == 125 and all(type(n) is int for n in drawn)
    ones = datasets.random_output_lens(1, 0.5, np.random.default_rng(0))
    assert [next(ones) for _ in range(5)] == [1] * 5


def test_random_prompts_lengths_ids_and_seeding() -> None:
    def take(seed: int, n: int = 400) -> list[list[int]]:
        stream = datasets.random_prompts(100, 0.25, np.random.default_rng(seed))
        return [next(stream) for _ in range(n)]

    prompts = take(1)
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 75 and max(lengths) == 125  # both ends of [75, 125] are drawn
    ids = [t for p in prompts for t in p]
    assert all(type(t) is int for t in ids)  # plain ints: they are sent as JSON
    assert min(ids) == 0 and max(ids) == datasets.VOCAB - 1
    assert take(1) == prompts and take(2) != prompts


# --- traces ------------------------------------------------------------------------------------

TRACE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,100,8

2023-11-16 18:17:05.0000001,300,27
2023-11-16 18:18:03.9799600,0,14
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_timestamps_with_seven_fractional_digits() -> None:
    base = datasets.parse_timestamp_ns("2023-11-16 18:17:03")
    assert datasets.parse_timestamp_ns("2023-11-16 18:17:03.9799600") - base == 979_960_000
    assert datasets.parse_timestamp_ns("2023-11-16T18:17:03.5") - base == 500_000_000
    assert datasets.parse_timestamp_ns("2023-11-16 18:17:03.1234567899") - base == 123_456_789  # truncated
    midnight = datasets.parse_timestamp_ns("2023-11-17 00:00:00.0000001")
    assert midnight - datasets.parse_timestamp_ns("2023-11-16 23:59:59.9999999") == 200
    for bad in ["2023-11-16", "2023-13-01 00:00:00.1", "2023-02-30 00:00:00", "yesterday"]:
        with pytest.raises(ValueError):
            datasets.parse_timestamp_ns(bad)


def test_trace_offsets_are_relative_to_the_first_request(tmp_path: Path) -> None:
    trace = datasets.read_trace(write(tmp_path, TRACE))
    assert [t.context_tokens for t in trace] == [4808, 100, 300, 0]
    assert [t.generated_tokens for t in trace] == [10, 8, 27, 14]
    assert [t.offset_s for t in trace] == pytest.approx([0.0, 0.052, 1.0200401, 60.0], abs=1e-9)
    without = datasets.read_trace(write(tmp_path, "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,5\n"))
    assert without == [datasets.TraceRequest(0.0, 5, None)]  # GeneratedTokens is optional


def test_trace_time_scale_duration_limit_and_clamping(tmp_path: Path) -> None:
    trace = datasets.read_trace(write(tmp_path, TRACE))
    plan = datasets.plan_trace(trace, time_scale=10.0, max_input_len=256)
    assert plan.offsets_s == pytest.approx([0.0, 0.0052, 0.10200401, 6.0], abs=1e-9)
    assert plan.lengths == [256, 100, 256, 1]  # an empty prompt is sent as one token
    assert plan.clamped == 2
    within = datasets.plan_trace(trace, duration_s=1.0)  # 1.02 s is past the end
    assert within.lengths == [256, 100] and within.clamped == 1  # only the replayed part is counted
    assert datasets.plan_trace(trace, limit=3, max_input_len=5000).lengths == [4808, 100, 300]
    assert datasets.plan_trace(trace, max_input_len=5000).clamped == 0


def test_trace_output_lengths_are_generated_tokens_clamped(tmp_path: Path) -> None:
    trace = datasets.read_trace(write(tmp_path, TRACE.replace("0,14", "0,0")))
    assert datasets.plan_trace(trace).output_lens == [1, 1, 1, 1]  # the default: prefill only
    assert datasets.plan_trace(trace, max_output_len=20).output_lens == [10, 8, 20, 1]  # a recorded 0 asks for 1
    assert datasets.plan_trace(trace, max_output_len=1000, limit=2).output_lens == [10, 8]
    with pytest.raises(ValueError, match="maximum output length"):
        datasets.plan_trace(trace, max_output_len=0)
    bare = datasets.read_trace(write(tmp_path, "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,5\n"))
    assert datasets.plan_trace(bare).output_lens == [1]
    with pytest.raises(datasets.TraceError, match="no GeneratedTokens column"):
        datasets.plan_trace(bare, max_output_len=2)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (TRACE.replace("2023-11-16 18:17:04.0319600", "not-a-time"), "trace.csv:3: not a timestamp"),
        (TRACE.replace("300,27", "lots,27"), "trace.csv:5: ContextTokens must be an integer"),
        (TRACE.replace("100,8", "-5,8"), "trace.csv:3: ContextTokens must be >= 0"),
        (TRACE.replace(",4808,10", ""), "trace.csv:2: expected at least 3 fields"),
        (TRACE.replace("300,27", "300,lots"), "trace.csv:5: GeneratedTokens must be an integer"),
        (TRACE.replace("100,8", "100,-8"), "trace.csv:3: GeneratedTokens must be >= 0"),
        ("TIME,Tokens\n2023-11-16 18:17:03.9799600,1\n", "no TIMESTAMP column"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("", "empty"),
    ],
)
def test_a_malformed_trace_names_the_line(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(datasets.TraceError, match=fragment):
        datasets.read_trace(write(tmp_path, text))


def test_a_missing_trace_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(datasets.TraceError, match="cannot read the trace"):
        datasets.read_trace(tmp_path / "nope.csv")


def test_trace_workload(tmp_path: Path) -> None:
    cfg = BenchmarkConfig(dataset="trace", trace=str(write(tmp_path, TRACE)), time_scale=2.0, max_input_len=200)
    work = build_workload(cfg)
    sent = list(work.requests)
    assert [r.offset_s for r in sent] == pytest.approx([0.0, 0.026, 0.51002005, 30.0])
    assert [len(r.prompt) for r in sent] == [200, 100, 200, 1]
    assert [r.max_tokens for r in sent] == [1, 1, 1, 1]  # prefill only unless --max-output-len says more
    assert work.total == 4 and work.clamped == 2
    cfg.max_output_len = 12
    decoding = list(build_workload(cfg).requests)
    assert [r.max_tokens for r in decoding] == [10, 8, 12, 12]  # GeneratedTokens, clamped
    assert [r.prompt for r in decoding] == [r.prompt for r in sent]  # the same prompts


def test_the_old_spelling_of_the_trace_speedup_works_and_says_its_new_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(write(tmp_path, TRACE))
    cfg = parse_config(["--trace", trace, "--time-scale", "4"])
    assert cfg.time_scale == 4.0
    err = capsys.readouterr().err
    assert "--time-scale is now --trace-speedup" in err and "BUBBLETEA_TIME_SCALE" in err
    assert parse_config(["--trace", trace, "--trace-speedup", "4"]).time_scale == 4.0
    assert "now" not in capsys.readouterr().err


def test_prompt_lengths_drawn_from_a_trace_keep_the_requested_rate(tmp_path: Path) -> None:
    """--input-lens-from: a trace's prompt lengths (clamped), at arrivals of --request-rate."""
    trace = str(write(tmp_path, TRACE))
    cfg = parse_config(
        ["--request-rate", "50", "--num-prompts", "400", "--input-lens-from", trace, "--max-input-len", "256"]
    )
    assert cfg.dataset == "random" and cfg.input_lens_from == trace and cfg.max_input_len == 256
    sent = list(build_workload(cfg).requests)
    assert {len(r.prompt) for r in sent} == {256, 100, 1}  # 4808 and 300 clamped to 256, 0 sent as 1
    assert 400 / sent[-1].offset_s == pytest.approx(50, rel=0.2)  # the rate asked for, not the trace's
    assert sent == list(build_workload(cfg).requests)  # seeded
    for bad in (["--input-len", "8"], ["--trace", trace]):
        with pytest.raises(SystemExit):
            parse_config(["--input-lens-from", trace, *bad])


def test_random_workload_is_reproducible_and_bounded_by_duration() -> None:
    cfg = BenchmarkConfig(request_rate=50.0, num_prompts=None, duration_s=1.0, input_len=8)
    first = list(build_workload(cfg).requests)
    assert first == list(build_workload(cfg).requests)
    assert 25 < len(first) < 80 and all(r.offset_s < 1.0 for r in first)
    # The prompts do not depend on the rate: a rate sweep compares like with like.
    faster = list(build_workload(BenchmarkConfig(request_rate=80.0, num_prompts=5, input_len=8)).requests)
    assert [r.prompt for r in faster] == [r.prompt for r in first[:5]]
    assert all(r.max_tokens == 1 for r in first)


def test_random_output_len_sets_max_tokens_without_changing_the_prompts() -> None:
    plain = list(build_workload(BenchmarkConfig(num_prompts=300, input_len=8, range_ratio=0.5)).requests)
    assert {r.max_tokens for r in plain} == {1}  # 1 stays exactly 1 whatever the range ratio
    cfg = BenchmarkConfig(num_prompts=300, input_len=8, range_ratio=0.5, output_len=40)
    decoding = list(build_workload(cfg).requests)
    assert min(r.max_tokens for r in decoding) == 20 and max(r.max_tokens for r in decoding) == 60
    assert [r.prompt for r in decoding] == [r.prompt for r in plain]  # a separate random stream
    assert decoding == list(build_workload(cfg).requests)  # seeded
    fixed = BenchmarkConfig(num_prompts=5, output_len=7)
    assert [r.max_tokens for r in build_workload(fixed).requests] == [7] * 5  # range ratio 0: exactly


# --- the summary -------------------------------------------------------------------------------


def ok(ttft_ms: float, tokens: int, output_tokens: int = 1) -> Outcome:
    return Outcome(True, tokens, ttft_s=ttft_ms / 1000, status=200, output_tokens=output_tokens)


def bad(kind: str, message: str, status: int | None = None) -> Outcome:
    return Outcome.failure(kind, message, 9, status)


OUTCOMES = [
    ok(10, 5),
    bad("429", "the queue is full", 429),
    ok(20, 6),
    bad("timeout", "no result within 1s"),
    ok(30, 7, output_tokens=0),  # the server gave no count: one token, as vLLM counts without a tokenizer
    bad("429", "the queue is full", 429),
    bad("504", "still queued", 504),
    ok(40, 8),
    bad("connection_error", "connection refused"),
]


def test_summary_numbers() -> None:
    s = report.summarize(OUTCOMES, 2.0, goodput={"ttft": 20.0}, percentiles=[50, 90, 99, 99.9], clamped_prompts=3)
    assert s["duration"] == 2.0
    assert s["completed"] == 4 and s["failed"] == 5
    assert s["error_counts"] == {"429": 2, "504": 1, "connection_error": 1, "timeout": 1}
    assert list(s["error_counts"]) == ["429", "504", "connection_error", "timeout"]  # statuses first
    assert s["total_input_tokens"] == 26  # successful requests only
    assert s["total_output_tokens"] == 4  # one token per answered prefill
    assert s["request_throughput"] == 2.0 and s["input_throughput"] == 13.0
    assert s["output_throughput"] == 2.0 and s["total_token_throughput"] == 15.0
    assert s["request_goodput"] == 1.0  # 10 and 20 ms meet ttft <= 20 ms (inclusive); 30 and 40 do not
    assert s["goodput_slos_ms"] == {"ttft": 20.0}
    assert s["mean_ttft_ms"] == pytest.approx(25.0) and s["median_ttft_ms"] == pytest.approx(25.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(125))  # population std, as vLLM
    assert s["p50_ttft_ms"] == pytest.approx(25.0)
    assert s["p90_ttft_ms"] == pytest.approx(37.0)  # linear interpolation between 30 and 40
    assert s["p99_ttft_ms"] == pytest.approx(39.7)
    assert s["p99.9_ttft_ms"] == pytest.approx(39.97)
    assert s["ttfts_ms"] == pytest.approx([10, 20, 30, 40])
    assert s["clamped_prompts"] == 3
    assert [(e["error"], e["message"]) for e in s["error_samples"]] == [
        ("429", "the queue is full"),  # distinct messages only
        ("timeout", "no result within 1s"),
        ("504", "still queued"),
        ("connection_error", "connection refused"),
    ]


def test_per_request_lists_are_vllms() -> None:
    # One entry per request, in send order, as vLLM writes them: a failed request has TTFT 0.0,
    # output length 0 and its error; a successful one has the error "".
    s = report.summarize(OUTCOMES, 2.0)
    assert s["ttfts"] == pytest.approx([0.010, 0.0, 0.020, 0.0, 0.030, 0.0, 0.0, 0.040, 0.0])  # seconds
    assert s["input_lens"] == [5, 9, 6, 9, 7, 9, 9, 8, 9]
    assert s["output_lens"] == [1, 0, 1, 0, 1, 0, 0, 1, 0]
    assert s["errors"] == [
        "",
        "HTTP 429: the queue is full",
        "",
        "timeout: no result within 1s",
        "",
        "HTTP 429: the queue is full",
        "HTTP 504: still queued",
        "",
        "connection_error: connection refused",
    ]


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ('ttft;dur=12.5;desc="front door: receipt to first token"', 0.0125),
        ("db;dur=3, ttft;desc=x;dur=250", 0.25),  # among other metrics, its params in any order
        ('ttft;dur="7"', 0.007),  # a quoted value
        ("xttft;dur=9, ttft2;dur=4", None),  # only the metric named ttft
        ("ttft", None),  # no duration
        (None, None),  # a server that does not say (vLLM)
    ],
)
def test_the_servers_own_ttft_is_read_from_its_server_timing_header(header: str | None, seconds: float | None) -> None:
    assert server_ttft_s(header) == (pytest.approx(seconds) if seconds is not None else None)


def test_the_servers_ttfts_are_listed_per_request_and_none_where_it_did_not_say() -> None:
    outcomes = [Outcome(True, 5, ttft_s=0.3, server_ttft_s=0.2), Outcome(True, 5, ttft_s=0.1), bad("429", "full", 429)]
    assert report.summarize(outcomes, 1.0)["server_ttfts"] == [0.2, None, None]


def test_summary_without_successes_or_time() -> None:
    s = report.summarize([bad("400", "too long", 400)], 0.0, metrics=["e2el"])
    assert s["completed"] == 0 and s["request_throughput"] == 0.0 and s["request_goodput"] is None
    assert s["mean_ttft_ms"] is None and s["p99_e2el_ms"] is None and s["ttfts_ms"] == []
    assert s["ttfts"] == [0.0] and s["output_lens"] == [0] and s["errors"] == ["HTTP 400: too long"]
    assert "p99_ttft_ms" not in s  # percentiles only for the chosen metrics; the mean always
    assert "Mean E2EL (ms):                          n/a" in report.format_summary(s)


def decoded(ttft_ms: float, itls_ms: list[float], output_tokens: int, e2el_ms: float | None = None) -> Outcome:
    """A streamed completion: its first chunk at `ttft_ms`, one more chunk after each gap."""
    end = ttft_ms + sum(itls_ms) if e2el_ms is None else e2el_ms
    itls = tuple(gap / 1000 for gap in itls_ms)
    return Outcome(
        True, 10, ttft_s=ttft_ms / 1000, status=200, output_tokens=output_tokens, latency_s=end / 1000, itls=itls,
        streamed=True,
    )  # fmt: skip


DECODED = [
    decoded(100, [50, 100, 150], 5),  # e2el 400, TPOT (400 - 100) / 4 = 75
    decoded(200, [20, 20], 3),  # e2el 240, TPOT 40 / 2 = 20
    decoded(30, [], 1),  # one token: no TPOT, no ITL (and TPOT 0 for goodput, as vLLM)
    Outcome(True, 10, ttft_s=0.5, status=200, output_tokens=4),  # not streamed: TTFT = e2el, no TPOT/ITL
    bad("429", "the queue is full", 429),
]


def test_decoding_metrics_are_vllms() -> None:
    s = report.summarize(DECODED, 2.0, metrics=["ttft", "tpot", "itl", "e2el"], percentiles=[50, 99])
    assert s["output_lens"] == [5, 3, 1, 4, 0] and s["total_output_tokens"] == 13
    assert s["output_throughput"] == 6.5 and s["total_token_throughput"] == 26.5
    # TPOT per request with more than one token, streamed: (e2el - ttft) / (output tokens - 1).
    assert report.tpot_s(DECODED[0]) == pytest.approx(0.075) and report.tpot_s(DECODED[1]) == pytest.approx(0.02)
    assert [report.tpot_s(o) for o in DECODED[2:]] == [None, None, None]
    assert s["mean_tpot_ms"] == pytest.approx(47.5) and s["median_tpot_ms"] == pytest.approx(47.5)
    assert s["std_tpot_ms"] == pytest.approx(27.5) and s["p99_tpot_ms"] == pytest.approx(74.45)
    # ITLs: every gap of every request, pooled (one per chunk after the first).
    assert s["mean_itl_ms"] == pytest.approx(68.0) and s["median_itl_ms"] == pytest.approx(50.0)
    assert s["std_itl_ms"] == pytest.approx(math.sqrt(2536)) and s["p99_itl_ms"] == pytest.approx(148.0)
    assert s["p50_itl_ms"] == pytest.approx(50.0)
    assert s["itls"] == [pytest.approx([0.05, 0.1, 0.15]), pytest.approx([0.02, 0.02]), [], [], []]  # seconds
    # E2EL: to the last chunk with a choice (vLLM), or the whole answer.
    assert s["mean_e2el_ms"] == pytest.approx((400 + 240 + 30 + 500) / 4)
    assert s["ttfts"] == pytest.approx([0.1, 0.2, 0.03, 0.5, 0.0])
    assert json.loads(json.dumps(s)) == s


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"tpot": 50.0}, 2),  # 20 ms, and the one-token request (0); 75 ms is over, the unstreamed unmeasured
        ({"tpot": 76.0}, 3),
        ({"e2el": 300.0}, 2),  # 240 and 30 ms
        ({"tpot": 80.0, "e2el": 450.0}, 3),  # the unstreamed one is 500 ms end to end
        ({"ttft": 100.0, "tpot": 80.0}, 2),
    ],
)
def test_goodput_on_tpot_and_e2el(slos: dict[str, float], good: int) -> None:
    assert report.summarize(DECODED, 2.0, goodput=slos)["request_goodput"] == good / 2.0


def test_without_decoding_the_tpot_and_itl_are_none_and_not_shown() -> None:
    s = report.summarize(OUTCOMES, 2.0)  # prefills: one token each
    assert s["percentile_metrics"] == ["ttft", "tpot", "itl"]  # vLLM's default
    assert s["mean_tpot_ms"] is None and s["p99_tpot_ms"] is None and s["mean_itl_ms"] is None
    assert s["itls"] == [[]] * len(OUTCOMES)
    table = report.format_summary(s)
    assert "Time to First Token" in table and "TPOT" not in table and "ITL" not in table
    chosen = report.summarize(OUTCOMES, 2.0, metrics=["ttft"])
    assert "p99_tpot_ms" not in chosen and chosen["mean_tpot_ms"] is None  # mean/median/std always there


def test_the_table_shows_the_decoding_sections() -> None:
    lines = report.format_summary(report.summarize(DECODED, 2.0)).splitlines()
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Mean TPOT (ms):                          47.50" in lines
    assert "P99 TPOT (ms):                           74.45" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "Median ITL (ms):                         50.00" in lines
    assert "Output token throughput (tok/s):         6.50" in lines
    assert "Total Token throughput (tok/s):          26.50" in lines


def test_error_samples_are_capped_per_class() -> None:
    many = [bad("500", f"error {i}", 500) for i in range(10)]
    assert len(report.error_samples(many)) == report.SAMPLES_PER_ERROR


def test_summary_table() -> None:
    table = report.format_summary(report.summarize(OUTCOMES, 2.0, goodput={"ttft": 20.0}, metrics=["ttft", "e2el"]))
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     4" in lines
    assert "Total generated tokens:                  4" in lines
    assert "Request goodput (req/s):                 1.00" in lines
    assert "---------------Time to First Token----------------" in lines
    assert "P90 TTFT (ms):                           37.00" in lines
    assert "Median E2EL (ms):                        25.00" in lines
    assert not any(line.startswith("P50") for line in lines)  # the median says it
    assert (
        "HTTP 429:                                2" in lines and "timeout:                                 1" in lines
    )
    quiet = report.format_summary(report.summarize([ok(5, 1)], 1.0))
    assert "goodput" not in quiet and "Errors" not in quiet


def test_option_parsers() -> None:
    assert report.parse_metrics("ttft, E2EL,ttft") == ["ttft", "e2el"]
    assert report.parse_metrics("ttft,tpot,itl,e2el") == ["ttft", "tpot", "itl", "e2el"]  # vLLM's four
    assert report.parse_percentiles("50,99.9") == [50.0, 99.9]
    assert report.parse_goodput(["ttft:500", "e2el:800"]) == {"ttft": 500.0, "e2el": 800.0}
    assert report.parse_goodput(["ttft:250,e2el:300"]) == {"ttft": 250.0, "e2el": 300.0}
    assert report.parse_goodput(["TPOT:50", "e2el:900,ttft:1e3"]) == {"tpot": 50.0, "e2el": 900.0, "ttft": 1000.0}
    for text in ["tbt", "ttft,goodput", ""]:
        with pytest.raises(ValueError):
            report.parse_metrics(text)
    for text in ["101", "p99", ""]:
        with pytest.raises(ValueError):
            report.parse_percentiles(text)
    for item in ["ttft", "itl:5", "ttft:-1", "ttft:soon", "tpot:0"]:  # no ITL objective: vLLM has none
        with pytest.raises(ValueError):
            report.parse_goodput([item])


# --- the client's pure parts -------------------------------------------------------------------


def test_poll_backoff_doubles_to_a_cap() -> None:
    delays = poll_delays()
    assert [round(next(delays), 3) for _ in range(8)] == [0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]


def test_base_url_and_error_messages() -> None:
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url("http://h:8000/") == "http://h:8000"
    assert error_message({"error": {"message": "queue full"}}, "{...}") == "queue full"
    assert error_message(None, "<html>Bad Gateway</html>\n") == "<html>Bad Gateway</html>"


async def _lines(*lines: bytes) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


async def test_server_sent_events_are_split_at_blank_lines() -> None:
    body = [b": keep-alive\n", b"\n", b'data: {"a": 1}\n', b"\n", b"event: x\n", b"data: one\r\n"]
    body += [b"data:two\n", b"\n", b"data: [DONE]\n", b"\n", b"data: cut"]
    assert [d async for d in sse_data(_lines(*body))] == ['{"a": 1}', "one\ntwo", "[DONE]", "cut"]


def chunk(text: str | None = "A", **extra: object) -> str:
    """A chunk as the front door streams it (services/prefill_queue/completions.py)."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "bubbletea-gpt"}
    return json.dumps({**head, "choices": choices, **extra})


def test_the_first_token_is_the_first_chunk_with_a_choice() -> None:
    tally = StreamTally(200)
    assert not tally.feed(chunk(None, usage=None), now=1.0)  # no choice: not a token
    assert not tally.feed(chunk("", usage=None), now=2.0)  # a choice with empty text is one (vLLM)
    assert not tally.feed(chunk("B", usage=None), now=3.0)
    assert not tally.feed(chunk(None, usage={"prompt_tokens": 12, "completion_tokens": 2}), now=4.0)
    assert tally.feed("[DONE]", now=5.0)
    answer = tally.answer(sent_tokens=10)
    assert (answer.first_token_at, answer.prompt_tokens, answer.output_tokens) == (2.0, 12, 2)
    assert (answer.last_token_at, answer.itls) == (3.0, (1.0,))  # the usage chunk is no token


def test_every_later_chunk_with_a_choice_is_one_inter_token_latency() -> None:
    tally = StreamTally(200)
    for now, text in [(0.5, "A"), (0.75, "BC"), (1.0, ""), (1.5, "D")]:  # "BC": two tokens, one gap (vLLM)
        assert not tally.feed(chunk(text, usage=None), now=now)
    tally.feed(chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 5}), now=2.0)
    answer = tally.answer(sent_tokens=3)
    assert (answer.first_token_at, answer.last_token_at, answer.output_tokens) == (0.5, 1.5, 5)
    assert answer.itls == (0.25, 0.25, 0.5)
    uncounted = StreamTally(200)  # no usage chunk: one token per chunk with a choice
    for now in (1.0, 2.0, 4.0):
        uncounted.feed(chunk("x"), now=now)
    assert uncounted.answer(sent_tokens=3).output_tokens == 3
    without_usage = StreamTally(200)
    without_usage.feed(chunk("A"), now=1.0)
    assert without_usage.answer(sent_tokens=10).prompt_tokens == 10  # as sent; one token per chunk
    assert without_usage.answer(sent_tokens=10).output_tokens == 1


@pytest.mark.parametrize(
    ("data", "kind", "status"),
    [
        ('{"error": {"message": "the prefill failed: boom", "code": 503}}', "503", 503),
        ('{"error": {"message": "it broke"}}', "failed", 200),
        ('{"error": "plain"}', "failed", 200),
        ("not json", "bad_response", 200),
    ],
)
def test_an_error_event_fails_the_request_by_its_code(data: str, kind: str, status: int) -> None:
    tally = StreamTally(200)
    tally.feed(chunk("A"), now=1.0)  # a token first does not save it
    with pytest.raises(RequestFailed) as exc:
        tally.feed(data, now=2.0)
    assert (exc.value.kind, exc.value.status) == (kind, status)


def test_a_stream_without_a_token_is_a_bad_response() -> None:
    tally = StreamTally(200)
    tally.feed(chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 0}), now=1.0)
    with pytest.raises(RequestFailed, match="without a chunk with a choice") as exc:
        tally.answer(sent_tokens=3)
    assert exc.value.kind == "bad_response"


# --- sending on schedule -----------------------------------------------------------------------


class FakeClient:
    """Answers after `delay_s`, recording how many requests were in flight at most."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.inflight, self.peak, self.sent = delay_s, 0, 0, 0
        self.max_tokens: list[int] = []

    async def send(self, prompt: list[int], max_tokens: int = 1) -> Outcome:
        self.max_tokens.append(max_tokens)
        self.inflight += 1
        self.sent += 1
        self.peak = max(self.peak, self.inflight)
        await asyncio.sleep(self.delay_s)
        self.inflight -= 1
        return ok(self.delay_s * 1000, len(prompt))


async def test_max_concurrency_caps_requests_in_flight() -> None:
    client = FakeClient(0.01)
    work = Workload(iter([Request(0.0, [i + 1] * (i + 1), i + 1) for i in range(12)]), 12)
    outcomes, duration = await drive(client, work, BenchmarkConfig(max_concurrency=3, disable_tqdm=True))
    assert client.peak == 3 and [o.prompt_tokens for o in outcomes] == list(range(1, 13))  # in send order
    assert client.max_tokens == list(range(1, 13))  # each request's max_tokens is sent
    assert duration >= 0.04  # four rounds of three


async def test_sending_follows_the_schedule_and_stops_at_the_duration() -> None:
    client = FakeClient(0.0)
    work = Workload(iter([Request(0.0, [1]), Request(0.05, [2]), Request(10.0, [3])]), 3)
    t0 = time.perf_counter()
    outcomes, _ = await drive(client, work, BenchmarkConfig(duration_s=0.2, disable_tqdm=True))
    elapsed = time.perf_counter() - t0
    # The third is due after the end: not sent, and not waited for either (the run ends near the
    # 0.2 s duration, far from the third's 10 s: the bound tells the two apart on a busy machine).
    assert len(outcomes) == 2 and 0.04 < elapsed < 5.0


async def test_warmups_send_the_first_prompt_and_leave_the_workload_whole() -> None:
    client = FakeClient(0.01)
    work = Workload(iter([Request(0.0, [7, 7], 9), Request(0.0, [8])]), 2)
    await warm_up(client, work, BenchmarkConfig(num_warmups=5, max_concurrency=2))
    assert client.sent == 5 and client.peak == 2  # all awaited, within --max-concurrency
    assert client.max_tokens == [9] * 5  # the first request as it is, max_tokens included
    assert [r.prompt for r in work.requests] == [[7, 7], [8]]  # the measured run still sends both
    await warm_up(client, Workload(iter([]), 0), BenchmarkConfig(num_warmups=3))  # nothing to send
    assert client.sent == 5


# --- the command line --------------------------------------------------------------------------


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    options = ["--request-rate", "--burstiness", "--trace", "--trace-speedup", "--goodput", "--json-out", "--dataset"]
    options += ["--dataset-name", "--random-input-len", "--random-range-ratio", "--save-result", "--result-dir"]
    options += ["--result-filename", "--metadata", "--label", "--num-warmups", "--header", "--no-stream"]
    options += ["--ready-check-timeout-sec", "--input-len", "--range-ratio", "--random-output-len"]
    options += ["--max-output-len", "--ignore-eos"]
    for option in options:
        assert option in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--trace", "t.csv", "--request-rate", "5"], "--request-rate does not apply with --trace"),
        (["--trace", "t.csv", "--burstiness", "2"], "--burstiness does not apply with --trace"),
        (["--trace", "t.csv", "--dataset", "random"], "conflict"),
        (["--dataset", "trace"], "needs --trace"),
        (["--trace-speedup", "10"], "--trace-speedup applies only with --trace"),
        (["--percentile-metrics", "ttft,tbt"], "unknown metric 'tbt'"),
        (["--goodput", "ttft"], "METRIC:MS"),
        (["--goodput", "itl:5"], "METRIC:MS with METRIC one of ttft, tpot, e2el"),
        (["--no-stream", "--goodput", "tpot:50"], "--goodput tpot needs a streamed answer"),
        (["--random-output-len", "0"], "output length must be >= 1"),
        (["--random-output-len", "4", "--random-range-ratio", "1"], "range ratio must be in [0, 1)"),
        (["--trace", "t.csv", "--random-output-len", "5"], "--random-output-len does not apply with --trace"),
        (["--max-output-len", "5"], "--max-output-len applies only with --trace"),
        (["--trace", "t.csv", "--max-output-len", "0"], "--max-output-len must be >= 1"),
        (["--endpoint", "/v1/prefill", "--random-output-len", "8"], "/v1/prefill answers one token"),
        (["--endpoint", "native", "--trace", "t.csv", "--max-output-len", "8"], "/v1/prefill answers one token"),
        (["--request-rate", "0"], "must be > 0"),
        (["--range-ratio", "1.5"], "range ratio"),
        (["--duration", "10"], "needs --max-concurrency"),
        (["--endpoint", "chat"], "invalid choice"),
        (["--endpoint", "/v1/chat/completions"], "invalid choice"),
        (["--dataset-name", "sharegpt"], "invalid choice"),
        (["--trace", "t.csv", "--random-input-len", "5"], "--random-input-len/--input-len does not apply with --trace"),
        (["--trace", "t.csv", "--random-range-ratio", "0.5"], "--random-range-ratio/--range-ratio does not apply"),
        (["--random-range-ratio", "1.0"], "range ratio must be in [0, 1)"),
        (["--random-input-len", "0"], "input length must be >= 1"),
        (["--num-warmups", "-1"], "--num-warmups must be >= 0"),
        (["--ready-check-timeout-sec", "-1"], "--ready-check-timeout-sec must be >= 0"),
        (["--ready-check-timeout-sec", "soon"], "invalid float value"),
        (["--header", "x-run"], "--header 'x-run' is not KEY=VALUE"),
        (["--header", "=7"], "--header '=7' is not KEY=VALUE"),
        (["--header", "x run=7"], "--header: 'x run' is not a valid HTTP header name"),
        (["--header"], "expected at least one argument"),
        (["--metadata", "version"], "--metadata 'version' is not KEY=VALUE"),
        (["--metadata", "completed=7"], "--metadata would replace the result's completed"),
        (["--metadata", "p90_ttft_ms=1"], "--metadata would replace the result's p90_ttft_ms"),
        (["--result-dir", "out"], "--result-dir applies only with --save-result"),
        (["--result-filename", "r.json"], "--result-filename applies only with --save-result"),
        (["--save-result", "--result-filename", ""], "--result-filename must not be empty"),
        (["--endpoint", "/v1/prefill", "--no-stream"], "--no-stream applies only to the completions endpoint"),
        (["--endpoint", "native", "--stream"], "--stream applies only to the completions endpoint"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_config_defaults_and_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUBBLETEA_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-open")
    cfg = parse_config([])
    assert (cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.input_len) == (100, math.inf, 1.0, 128)
    assert cfg.api_key == "sk-open" and cfg.base_url == "http://127.0.0.1:8000"
    monkeypatch.setenv("BUBBLETEA_API_KEY", "bt-key")
    assert parse_config([]).api_key == "bt-key"
    assert parse_config(["--api-key", "given"]).api_key == "given"
    described = cfg.describe()
    assert "api_key" not in described and described["request_rate"] == "inf" and described["trace"] is None
    timed = parse_config(["--duration", "30", "--request-rate", "5", "--base-url", "http://x:1/v1"])
    assert timed.num_prompts is None and timed.duration_s == 30 and timed.base_url == "http://x:1"
    assert timed.describe()["duration_limit_s"] == 30


def test_vllm_flag_names_mean_the_same_as_loadgens() -> None:
    common = " --request-rate 5 --num-prompts 20"
    vllm = parse_config(
        shlex.split(
            "--endpoint /v1/completions --dataset-name random --random-input-len 64 --random-range-ratio 0.25" + common
        )
    )
    ours = parse_config(
        shlex.split("--endpoint completions --dataset random --input-len 64 --range-ratio 0.25" + common)
    )
    assert vllm == ours
    assert (vllm.endpoint, vllm.dataset, vllm.input_len, vllm.range_ratio) == ("completions", "random", 64, 0.25)
    assert parse_config(["--endpoint", "/v1/prefill"]).endpoint == "native"
    assert parse_config(["--endpoint", "native"]).endpoint == "native"


def test_new_options_and_their_defaults(tmp_path: Path) -> None:
    cfg = parse_config([])
    assert cfg.endpoint == "completions" and cfg.stream is True  # streams by default, as vLLM
    assert (cfg.num_warmups, cfg.ready_check_timeout_s, cfg.headers, cfg.metadata) == (0, 0.0, {}, {})
    assert (cfg.save_result, cfg.result_dir, cfg.result_filename, cfg.label) == (False, None, None, None)
    given = parse_config(
        shlex.split(
            "--no-stream --num-warmups 3 --ready-check-timeout-sec 30 --label nightly --header x-run=7 "
            "'Authorization = Bearer b=c' --metadata version=0.3.3 tp=1 --save-result "
            f"--result-dir {tmp_path / 'new'} --result-filename r.json"
        )
    )
    assert given.stream is False and given.num_warmups == 3 and given.ready_check_timeout_s == 30.0
    assert given.headers == {"x-run": "7", "Authorization": "Bearer b=c"}  # split at the first '='
    assert given.metadata == {"version": "0.3.3", "tp": "1"} and given.label == "nightly"
    assert given.save_result and given.result_dir == str(tmp_path / "new") and given.result_filename == "r.json"
    described = given.describe()
    assert "headers" not in described and "metadata" not in described  # headers may carry credentials
    assert described["stream"] is False and described["num_warmups"] == 3
    assert parse_config(["--endpoint", "native"]).describe()["stream"] is None


def test_output_length_options() -> None:
    cfg = parse_config([])
    assert (cfg.output_len, cfg.max_output_len, cfg.ignore_eos) == (1, 1, False)  # prefill only by default
    assert cfg.percentile_metrics == ["ttft", "tpot", "itl"]  # vLLM's default
    given = parse_config(shlex.split("--random-output-len 64 --random-range-ratio 0.5 --ignore-eos --goodput tpot:50"))
    assert (given.output_len, given.range_ratio, given.ignore_eos, given.goodput) == (64, 0.5, True, {"tpot": 50.0})
    described = given.describe()
    assert (described["output_len"], described["max_output_len"], described["ignore_eos"]) == (64, None, True)
    trace = parse_config(["--trace", "t.csv", "--max-output-len", "256"])
    assert trace.max_output_len == 256 and trace.describe()["output_len"] is None
    assert trace.describe()["max_output_len"] == 256
    # A prefill-only service keeps working unchanged: the native API with the default of 1.
    assert parse_config(["--endpoint", "/v1/prefill", "--goodput", "tpot:5"]).output_len == 1


# --- the result JSON -----------------------------------------------------------------------------

VLLM_KEYS = [
    "date",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "std_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "std_itl_ms",
    "p99_itl_ms",
    "ttfts",
    "itls",
    "input_lens",
    "output_lens",
    "errors",
]


def test_the_result_has_vllms_keys_in_vllms_order() -> None:
    cfg = BenchmarkConfig(
        request_rate=20.0, burstiness=0.5, max_concurrency=4, num_prompts=9, goodput={"ttft": 20.0}, label="night"
    )
    cfg.metadata = {"version": "0.3.3", "tp": "1"}
    summary = report.summarize(OUTCOMES, 2.0, goodput=cfg.goodput)
    r = result.assemble(cfg, summary, model="org/bubbletea-gpt", base_url="http://h:1", date="20250102-030405")
    assert set(VLLM_KEYS) <= r.keys()
    assert list(r)[:8] == ["date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "version", "tp"]
    assert (r["date"], r["backend"], r["label"], r["model_id"], r["tokenizer_id"]) == (
        "20250102-030405",
        "openai",
        "night",
        "org/bubbletea-gpt",
        None,
    )
    assert (r["num_prompts"], r["request_rate"], r["burstiness"], r["max_concurrency"]) == (9, 20.0, 0.5, 4)
    assert (r["version"], r["tp"]) == ("0.3.3", "1")  # metadata at the top level, as vLLM
    assert (r["duration"], r["completed"], r["failed"]) == (2.0, 4, 5)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (26, 4)
    assert (r["request_throughput"], r["request_goodput"]) == (2.0, 1.0)
    assert (r["output_throughput"], r["total_token_throughput"]) == (2.0, 15.0)
    assert r["p99_ttft_ms"] == pytest.approx(39.7) and r["std_ttft_ms"] == pytest.approx(math.sqrt(125))
    assert r["ttfts"] == summary["ttfts"] and len(r["errors"]) == len(r["input_lens"]) == len(OUTCOMES)
    assert r["error_counts"] == {"429": 2, "504": 1, "connection_error": 1, "timeout": 1}
    assert (r["model"], r["base_url"], r["endpoint"]) == ("org/bubbletea-gpt", "http://h:1", "completions")
    assert json.loads(json.dumps(r)) == r  # JSON as it is
    native = result.assemble(
        BenchmarkConfig(endpoint="native"), report.summarize(OUTCOMES, 2.0), model=None, base_url="", date="d"
    )
    assert native["backend"] == "bubbletea" and native["label"] is None and native["request_goodput"] is None
    assert native["request_rate"] == "inf"


def test_saved_file_names_follow_vllm(tmp_path: Path) -> None:
    date = "20250102-030405"
    assert (
        result.default_filename(BenchmarkConfig(), "bubbletea-gpt", date) == f"openai-infqps-bubbletea-gpt-{date}.json"
    )
    cfg = BenchmarkConfig(endpoint="native", request_rate=20, max_concurrency=8, label="nightly")
    assert result.default_filename(cfg, "org/m", date) == f"nightly-20.0qps-concurrency8-m-{date}.json"
    trace = BenchmarkConfig(dataset="trace", trace="t.csv")
    assert result.default_filename(trace, None, date) == f"openai-trace-unknown-model-{date}.json"
    r = {"model_id": "bubbletea-gpt", "date": date}
    assert result.save_paths(BenchmarkConfig(), r) == []
    assert result.save_paths(BenchmarkConfig(json_out="a.json", save_result=True), r) == [
        Path("a.json"),
        Path(f"openai-infqps-bubbletea-gpt-{date}.json"),
    ]
    cfg = BenchmarkConfig(save_result=True, result_dir=str(tmp_path / "new"), result_filename="r.json")
    [path] = result.save_paths(cfg, r)
    assert path == tmp_path / "new" / "r.json"
    result.write(path, {"completed": 1})  # the folder is created, as vLLM does
    assert json.loads(path.read_text()) == {"completed": 1}


def test_recorded_configuration_does_not_shadow_results(tmp_path: Path) -> None:
    results = report.summarize(OUTCOMES, 1.0, goodput={"ttft": 1.0}, metrics=["ttft", "e2el"])
    for cfg in [BenchmarkConfig(duration_s=5.0, goodput={"ttft": 1.0}), BenchmarkConfig(dataset="trace", trace="t")]:
        assert not cfg.describe().keys() & results.keys()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--base-url", url, "--disable-tqdm", "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"loadgen: error: cannot reach the BubbleTea API at {url}: ")
    assert err.endswith("(is `bubbletea up` running?)") and "\n" not in err


def test_the_ready_check_retries_then_says_how_long_it_waited(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--base-url", url, "--disable-tqdm", "--ready-check-timeout-sec", "0.3"]) == 1
    err = capsys.readouterr().err.strip()
    assert "connection refused" in err and err.endswith("gave up after 0.3s (--ready-check-timeout-sec)")


def test_the_command_lines_in_the_docs_parse() -> None:
    """docs/loadgen.md's first example block: the vLLM-style command and loadgen's own."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "loadgen.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("loadgen ")]
    assert len(commands) == 2 and "--dataset-name" in commands[0]
    vllm, ours = (parse_config(argv[1:]) for argv in commands)
    assert vllm.save_result and vllm.num_warmups == 10 and vllm.metadata == {"run": "1"}
    assert (vllm.input_len, vllm.range_ratio, vllm.request_rate, vllm.num_prompts) == (
        ours.input_len,
        ours.range_ratio,
        ours.request_rate,
        ours.num_prompts,
    )


def test_the_decoding_command_line_in_the_docs_parses() -> None:
    """docs/loadgen.md's second example block: vLLM's decoding benchmark."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "loadgen.md").read_text()
    block = text.split("```bash\n")[2].split("```", 1)[0].replace("\\\n", " ")
    [argv] = [shlex.split(line) for line in block.splitlines() if line.startswith("loadgen ")]
    cfg = parse_config(argv[1:])
    assert (cfg.output_len, cfg.range_ratio, cfg.goodput) == (64, 0.5, {"ttft": 500.0, "tpot": 50.0})


def test_a_bad_trace_exits_2_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, TRACE.replace("100,8", "x,8"))
    assert main(["--trace", str(path), "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "trace.csv:3:" in err and "Traceback" not in err


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "loadgen", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: loadgen" in done.stdout
