"""Turning request outcomes into the benchmark's numbers and its text table (pure).

The numbers follow `vllm bench serve` so results can be compared, under vLLM's keys: throughputs
are over the benchmark's wall-clock duration (first send to last answer), latency statistics are
over the successful requests only, percentiles are numpy's rule (linear interpolation, in
`shared.figures.percentiles`), std is the
population std, and the per-request lists (`ttfts`, `itls`, `input_lens`, `output_lens`, `errors`)
have one entry per request in send order. The decoding metrics are vLLM's: a request's TPOT is
(e2el - ttft) / (output tokens - 1) when it has more than one output token, and the ITLs of all
requests are pooled (one per streamed chunk after the first). Two differences: with no value the
statistics are None, not vLLM's 0 (which would read as a wonderfully fast server), and failed
requests are also counted by class (`error_counts`) and sampled (`error_samples`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from loadgen.outcome import Outcome
from shared.figures.percentiles import percentile

#: The latency metrics a report can show, with vLLM's names and headings. A prefill (max_tokens 1)
#: answers with its first and only token, so its end-to-end latency is its TTFT and it has no TPOT
#: nor ITL.
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
#: --percentile-metrics' default: vLLM's.
DEFAULT_METRICS = ("ttft", "tpot", "itl")
#: Metrics whose mean, median and std are always in the result (percentiles when chosen).
ALWAYS = ("ttft", "tpot", "itl")
#: What a --goodput objective may bound: vLLM's (the ITL is not one value per request).
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
#: At most this many distinct messages are kept per error class in error_samples.
SAMPLES_PER_ERROR = 3
WIDTH = 50


# --- parsing the report options ------------------------------------------------------------------


def parse_metrics(text: str) -> list[str]:
    """'ttft,e2el' -> ['ttft', 'e2el']; unknown names raise ValueError listing the known ones."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no metric given")
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric {unknown[0]!r}; choose from {', '.join(METRICS)}")
    return list(dict.fromkeys(names))  # drop repeats, keep order


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0]; each must be a number in [0, 100]."""
    out: list[float] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        try:
            p = float(item)
        except ValueError:
            raise ValueError(f"percentile {item!r} is not a number") from None
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {item} is outside 0..100")
        out.append(p)
    if not out:
        raise ValueError("no percentile given")
    return list(dict.fromkeys(out))


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500'] -> {'ttft': 500.0}: service-level objectives in milliseconds, on ttft, tpot or
    e2el (vLLM's). Items may also be comma-separated ('ttft:500,tpot:50')."""
    slos: dict[str, float] = {}
    for item in (part.strip() for raw in items for part in raw.split(",")):
        if not item:
            continue
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            names = ", ".join(GOODPUT_METRICS)
            raise ValueError(f"goodput objective {item!r} must be METRIC:MS with METRIC one of {names}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"goodput objective {item!r}: {value!r} is not a number of milliseconds") from None
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"goodput objective {item!r}: the limit must be > 0 ms")
        slos[name] = limit
    if not slos:
        raise ValueError("no goodput objective given")
    return slos


def percentile_name(p: float) -> str:
    """50.0 -> '50', 99.9 -> '99.9': the name used in keys such as p99_ttft_ms."""
    return str(int(p)) if float(p).is_integer() else f"{p:g}"


# --- computing ---------------------------------------------------------------------------------


def tpot_s(outcome: Outcome) -> float | None:
    """vLLM's time per output token of one request, the first excluded: (e2el - ttft) / (output
    tokens - 1). None when it failed, has at most one output token, or was not streamed (its first
    token's time is not known: the TTFT is the whole answer)."""
    n = output_len(outcome)
    if not outcome.ok or not outcome.streamed or n <= 1 or outcome.ttft_s is None or outcome.e2el_s is None:
        return None
    return (outcome.e2el_s - outcome.ttft_s) / (n - 1)


def latency_ms(outcome: Outcome, metric: str) -> float | None:
    """A per-request metric (ttft, tpot, e2el) of one request, in ms; None if it failed or the
    metric does not apply (tpot_s). The ITL is not one value per request: see `values_ms`."""
    if metric not in METRICS or metric == "itl":
        raise ValueError(f"not a per-request metric: {metric!r}")
    if not outcome.ok:
        return None
    value = {"ttft": outcome.ttft_s, "e2el": outcome.e2el_s, "tpot": tpot_s(outcome)}[metric]
    return None if value is None else value * 1000.0


def values_ms(outcomes: Sequence[Outcome], metric: str) -> list[float]:
    """Every value of a metric over the successful requests, in ms, in send order: one per request
    where it applies, and for the ITL every gap of every request, pooled (as vLLM does)."""
    if metric == "itl":
        return [gap * 1000.0 for o in outcomes if o.ok for gap in o.itls]
    return [v for o in outcomes if (v := latency_ms(o, metric)) is not None]


def slo_ms(outcome: Outcome, metric: str) -> float | None:
    """What a goodput objective on `metric` checks: the metric, except that a request with at most
    one output token has a TPOT of 0 (vLLM's rule: it meets any TPOT objective)."""
    if metric == "tpot" and outcome.ok and output_len(outcome) <= 1:
        return 0.0
    return latency_ms(outcome, metric)


def _stats(values: list[float], metric: str, percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std and the percentiles; None when no request succeeded (0 would read as a
    wonderfully fast server)."""
    arr = np.asarray(values, dtype=float)
    have = arr.size > 0
    out: dict[str, float | None] = {
        f"mean_{metric}_ms": float(arr.mean()) if have else None,
        f"median_{metric}_ms": float(np.median(arr)) if have else None,
        f"std_{metric}_ms": float(arr.std()) if have else None,
    }
    for p in percentiles:
        out[f"p{percentile_name(p)}_{metric}_ms"] = percentile(values, p)
    return out


def error_label(kind: str) -> str:
    """'429' -> 'HTTP 429', 'timeout' -> 'timeout': how an error class is shown."""
    return f"HTTP {kind}" if kind.isdigit() else kind


def error_text(outcome: Outcome) -> str:
    """One request's entry in `errors` (vLLM's per-request list): '' when it succeeded."""
    if outcome.ok:
        return ""
    return f"{error_label(outcome.error or 'unknown')}: {outcome.message}"


def output_len(outcome: Outcome) -> int:
    """Output tokens of one request as vLLM counts them: the server's count, 1 when it gave none
    (no tokenizer to count with; a prefill answers one token), 0 for a failure."""
    if not outcome.ok:
        return 0
    return outcome.output_tokens or 1


def _error_key(key: str) -> tuple[int, int, str]:
    """HTTP statuses first, numerically, then the client's own classes by name."""
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def count_errors(outcomes: Sequence[Outcome]) -> dict[str, int]:
    counts = Counter(o.error or "unknown" for o in outcomes if not o.ok)
    return {k: counts[k] for k in sorted(counts, key=_error_key)}


def error_samples(outcomes: Sequence[Outcome], per_error: int = SAMPLES_PER_ERROR) -> list[dict[str, Any]]:
    """A few distinct messages per error class, in order of first occurrence: enough to see why
    requests failed without storing thousands of identical 429 messages."""
    seen: dict[str, list[str]] = {}
    samples: list[dict[str, Any]] = []
    for o in outcomes:
        if o.ok:
            continue
        kind = o.error or "unknown"
        messages = seen.setdefault(kind, [])
        if len(messages) < per_error and o.message not in messages:
            messages.append(o.message)
            samples.append({"error": kind, "status": o.status, "message": o.message})
    return samples


def is_good(outcome: Outcome, slos: dict[str, float]) -> bool:
    """Succeeded and met every objective (limits inclusive)."""
    if not outcome.ok:
        return False
    for metric, limit in slos.items():
        value = slo_ms(outcome, metric)
        if value is None or value > limit:
            return False
    return True


def summarize(
    outcomes: Sequence[Outcome],
    duration_s: float,
    *,
    metrics: Sequence[str] = DEFAULT_METRICS,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
    clamped_prompts: int = 0,
) -> dict[str, Any]:
    """The measured part of the result (the run adds its configuration), under vLLM's keys where
    vLLM has one. `duration_s` is the benchmark duration."""
    done = [o for o in outcomes if o.ok]

    def rate(n: float) -> float:
        return n / duration_s if duration_s > 0 else 0.0  # no time passed: nothing was measured

    total_input = sum(o.prompt_tokens for o in done)
    output_lens = [output_len(o) for o in outcomes]
    total_output = sum(output_lens)
    ttfts = values_ms(done, "ttft")
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": rate(len(done)),
        "request_goodput": rate(sum(is_good(o, goodput) for o in done)) if goodput else None,
        "output_throughput": rate(total_output),
        "total_token_throughput": rate(total_input + total_output),
        "input_throughput": rate(total_input),
        "goodput_slos_ms": dict(goodput) if goodput else None,
        "error_counts": count_errors(outcomes),
        "error_samples": error_samples(outcomes),
        "clamped_prompts": clamped_prompts,
        "percentile_metrics": list(metrics),
        "metric_percentiles": list(percentiles),
    }
    # TTFT, TPOT and ITL statistics are always there (their percentiles when asked for); E2EL's
    # when asked for.
    for metric in ALWAYS:
        summary.update(_stats(values_ms(done, metric), metric, percentiles if metric in metrics else ()))
    for metric in metrics:
        if metric not in ALWAYS:
            summary.update(_stats(values_ms(done, metric), metric, percentiles))
    # Per request, in send order, as vLLM writes them, in seconds; a failed request has TTFT 0.0
    # and no ITL.
    summary["ttfts"] = [o.ttft_s if o.ok and o.ttft_s is not None else 0.0 for o in outcomes]
    summary["itls"] = [list(o.itls) if o.ok else [] for o in outcomes]
    summary["input_lens"] = [o.prompt_tokens for o in outcomes]
    summary["output_lens"] = output_lens
    summary["errors"] = [error_text(o) for o in outcomes]
    summary["send_times"] = [o.sent_at for o in outcomes]  # ours: wall clock, to place each request in time
    # ours: seconds from each send to its answer's last token, or to its failure (how fast a 429 came)
    summary["answered_after"] = [o.e2el_s if o.e2el_s is not None else 0.0 for o in outcomes]
    summary["ttfts_ms"] = ttfts  # successful requests only, in ms (for plotting the distribution)
    # ours: the server's own TTFT of each answered request where it said (its Server-Timing header),
    # in seconds, else None: what the client's TTFT holds beyond it is the network and the client
    summary["server_ttfts"] = [o.server_ttft_s if o.ok else None for o in outcomes]
    return summary


# --- the text table ----------------------------------------------------------------------------


def _line(label: str, value: Any, fmt: str = "") -> str:
    shown = "n/a" if value is None else format(value, fmt)
    return f"{label:<40} {shown:<10}".rstrip()


def _rule(title: str = "", fill: str = "-") -> str:
    return f"{title:{fill}^{WIDTH}}"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the text table `vllm bench serve` prints."""
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _line("Successful requests:", summary["completed"]),
        _line("Failed requests:", summary["failed"]),
        _line("Benchmark duration (s):", summary["duration"], ".2f"),
        _line("Total input tokens:", summary["total_input_tokens"]),
        _line("Total generated tokens:", summary["total_output_tokens"]),
        _line("Request throughput (req/s):", summary["request_throughput"], ".2f"),
        _line("Input token throughput (tok/s):", summary["input_throughput"], ".1f"),
        _line("Output token throughput (tok/s):", summary["output_throughput"], ".2f"),
        _line("Total Token throughput (tok/s):", summary["total_token_throughput"], ".2f"),
    ]
    if summary.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", summary["request_goodput"], ".2f"))
    if summary.get("clamped_prompts"):
        lines.append(_line("Prompts clamped to --max-input-len:", summary["clamped_prompts"]))
    for metric in summary["percentile_metrics"]:
        if metric in ("tpot", "itl") and summary.get(f"mean_{metric}_ms") is None:
            continue  # nothing was decoded (or not streamed): no section, rather than a page of n/a
        short, title = METRICS[metric]
        lines.append(_rule(title))
        lines.append(_line(f"Mean {short} (ms):", summary[f"mean_{metric}_ms"], ".2f"))
        lines.append(_line(f"Median {short} (ms):", summary[f"median_{metric}_ms"], ".2f"))
        for p in summary["metric_percentiles"]:
            if p == 50:
                continue  # the median, just above
            name = percentile_name(p)
            lines.append(_line(f"P{name} {short} (ms):", summary[f"p{name}_{metric}_ms"], ".2f"))
    if summary["error_counts"]:
        lines.append(_rule("Errors"))
        for kind, count in summary["error_counts"].items():
            lines.append(_line(f"{error_label(kind)}:", count))
    lines.append("=" * WIDTH)
    return "\n".join(lines)
