"""The load generator's pure parts: arrivals, datasets, trace parsing, the summary, the CLI."""

from __future__ import annotations

import asyncio
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loadgen import arrivals, datasets, report
from loadgen.cli import BenchmarkConfig, Workload, build_workload, drive, main, parse_config
from loadgen.client import Outcome, error_message, normalize_base_url, poll_delays

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


def test_length_range() -> None:
    assert datasets.length_range(128, 0.0) == (128, 128)
    assert datasets.length_range(128, 0.5) == (64, 192)
    assert datasets.length_range(2, 0.9) == (1, 3)  # never below one token
    for bad in [(0, 0.0), (10, 1.0), (10, -0.1)]:
        with pytest.raises(ValueError):
            datasets.length_range(*bad)


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
    assert [t.offset_s for t in trace] == pytest.approx([0.0, 0.052, 1.0200401, 60.0], abs=1e-9)


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


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (TRACE.replace("2023-11-16 18:17:04.0319600", "not-a-time"), "trace.csv:3: not a timestamp"),
        (TRACE.replace("300,27", "lots,27"), "trace.csv:5: ContextTokens must be an integer"),
        (TRACE.replace("100,8", "-5,8"), "trace.csv:3: ContextTokens must be >= 0"),
        (TRACE.replace(",4808,10", ""), "trace.csv:2: expected at least 2 fields"),
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
    assert [o for o, _ in sent] == pytest.approx([0.0, 0.026, 0.51002005, 30.0])
    assert [len(p) for _, p in sent] == [200, 100, 200, 1]
    assert work.total == 4 and work.clamped == 2


def test_random_workload_is_reproducible_and_bounded_by_duration() -> None:
    cfg = BenchmarkConfig(request_rate=50.0, num_prompts=None, duration_s=1.0, input_len=8)
    first = list(build_workload(cfg).requests)
    assert first == list(build_workload(cfg).requests)
    assert 25 < len(first) < 80 and all(o < 1.0 for o, _ in first)
    # The prompts do not depend on the rate: a rate sweep compares like with like.
    faster = list(build_workload(BenchmarkConfig(request_rate=80.0, num_prompts=5, input_len=8)).requests)
    assert [p for _, p in faster] == [p for _, p in first[:5]]


# --- the summary -------------------------------------------------------------------------------


def ok(ttft_ms: float, tokens: int) -> Outcome:
    return Outcome(True, tokens, ttft_s=ttft_ms / 1000, status=200)


def bad(kind: str, message: str, status: int | None = None) -> Outcome:
    return Outcome.failure(kind, message, 9, status)


OUTCOMES = [
    ok(10, 5),
    bad("429", "the queue is full", 429),
    ok(20, 6),
    bad("timeout", "no result within 1s"),
    ok(30, 7),
    bad("429", "the queue is full", 429),
    bad("504", "still queued", 504),
    ok(40, 8),
    bad("connection_error", "connection refused"),
]


def test_summary_numbers() -> None:
    s = report.summarize(OUTCOMES, 2.0, goodput={"ttft": 20.0}, percentiles=[50, 90, 99, 99.9], clamped_prompts=3)
    assert s["completed"] == 4 and s["failed"] == 5
    assert s["errors"] == {"429": 2, "504": 1, "connection_error": 1, "timeout": 1}
    assert list(s["errors"]) == ["429", "504", "connection_error", "timeout"]  # statuses first
    assert s["total_input_tokens"] == 26  # successful requests only
    assert s["request_throughput"] == 2.0 and s["input_throughput"] == 13.0
    assert s["goodput"] == 1.0  # 10 and 20 ms meet ttft <= 20 ms (inclusive); 30 and 40 do not
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


def test_summary_without_successes_or_time() -> None:
    s = report.summarize([bad("400", "too long", 400)], 0.0, metrics=["e2el"])
    assert s["completed"] == 0 and s["request_throughput"] == 0.0 and s["goodput"] is None
    assert s["mean_ttft_ms"] is None and s["p99_e2el_ms"] is None and s["ttfts_ms"] == []
    assert "p99_ttft_ms" not in s  # percentiles only for the chosen metrics; the mean always
    assert "Mean E2EL (ms):                          n/a" in report.format_summary(s)


def test_error_samples_are_capped_per_class() -> None:
    many = [bad("500", f"error {i}", 500) for i in range(10)]
    assert len(report.error_samples(many)) == report.SAMPLES_PER_ERROR


def test_summary_table() -> None:
    table = report.format_summary(report.summarize(OUTCOMES, 2.0, goodput={"ttft": 20.0}, metrics=["ttft", "e2el"]))
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     4" in lines
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
    assert report.parse_percentiles("50,99.9") == [50.0, 99.9]
    assert report.parse_goodput(["ttft:500", "e2el:800"]) == {"ttft": 500.0, "e2el": 800.0}
    assert report.parse_goodput(["ttft:250,e2el:300"]) == {"ttft": 250.0, "e2el": 300.0}
    for text in ["itl", ""]:
        with pytest.raises(ValueError):
            report.parse_metrics(text)
    for text in ["101", "p99", ""]:
        with pytest.raises(ValueError):
            report.parse_percentiles(text)
    for item in ["ttft", "tpot:5", "ttft:-1", "ttft:soon"]:
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


# --- sending on schedule -----------------------------------------------------------------------


class FakeClient:
    """Answers after `delay_s`, recording how many requests were in flight at most."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.inflight, self.peak, self.sent = delay_s, 0, 0, 0

    async def send(self, prompt: list[int]) -> Outcome:
        self.inflight += 1
        self.sent += 1
        self.peak = max(self.peak, self.inflight)
        await asyncio.sleep(self.delay_s)
        self.inflight -= 1
        return ok(self.delay_s * 1000, len(prompt))


async def test_max_concurrency_caps_requests_in_flight() -> None:
    client = FakeClient(0.01)
    work = Workload(iter([(0.0, [i + 1] * (i + 1)) for i in range(12)]), 12)
    outcomes, duration = await drive(client, work, BenchmarkConfig(max_concurrency=3, disable_tqdm=True))
    assert client.peak == 3 and [o.prompt_tokens for o in outcomes] == list(range(1, 13))  # in send order
    assert duration >= 0.04  # four rounds of three


async def test_sending_follows_the_schedule_and_stops_at_the_duration() -> None:
    client = FakeClient(0.0)
    work = Workload(iter([(0.0, [1]), (0.05, [2]), (10.0, [3])]), 3)
    t0 = time.perf_counter()
    outcomes, _ = await drive(client, work, BenchmarkConfig(duration_s=0.2, disable_tqdm=True))
    elapsed = time.perf_counter() - t0
    # The third is due after the end: not sent, and not waited for either.
    assert len(outcomes) == 2 and 0.04 < elapsed < 0.5


# --- the command line --------------------------------------------------------------------------


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ["--request-rate", "--burstiness", "--trace", "--time-scale", "--goodput", "--json-out"]:
        assert option in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--trace", "t.csv", "--request-rate", "5"], "--request-rate does not apply with --trace"),
        (["--trace", "t.csv", "--burstiness", "2"], "--burstiness does not apply with --trace"),
        (["--trace", "t.csv", "--dataset", "random"], "conflict"),
        (["--dataset", "trace"], "needs --trace"),
        (["--time-scale", "10"], "--time-scale applies only with --trace"),
        (["--percentile-metrics", "ttft,itl"], "unknown metric 'itl'"),
        (["--goodput", "ttft"], "METRIC:MS"),
        (["--request-rate", "0"], "must be > 0"),
        (["--range-ratio", "1.5"], "range ratio"),
        (["--duration", "10"], "needs --max-concurrency"),
        (["--endpoint", "chat"], "invalid choice"),
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
    assert err.startswith(f"loadgen: cannot reach the BubbleTea API at {url}: ")
    assert err.endswith("(is `bubbletea up` running?)") and "\n" not in err


def test_a_bad_trace_exits_2_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, TRACE.replace("100,8", "x,8"))
    assert main(["--trace", str(path), "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "trace.csv:3:" in err and "Traceback" not in err


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "loadgen", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: loadgen" in done.stdout
