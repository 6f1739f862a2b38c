"""`BenchmarkConfig`: everything one load-generator run needs, validated in one place."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadgen import arrivals, datasets, report
from loadgen.client import ENDPOINTS, check_header

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
#: Fields `describe` leaves out: the API key and the headers may carry credentials, the metadata
#: goes to the result's top level, and the summary reports the rest itself (goodput_slos_ms, ...;
#: "request_goodput" there is the measured goodput).
NOT_RECORDED = ("api_key", "headers", "metadata", "disable_tqdm", "goodput", "percentile_metrics", "metric_percentiles")


@dataclass
class BenchmarkConfig:
    """Everything a run needs. Built by the CLI from its options, or directly by other code."""

    base_url: str = DEFAULT_BASE_URL
    endpoint: str = "completions"
    model: str | None = None  # None: the first model GET /v1/models lists
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = 100  # None: only duration_s limits the run
    duration_s: float | None = None
    dataset: str = "random"  # or "trace"
    input_len: int = 128
    range_ratio: float = 0.0
    output_len: int = 1  # random dataset: mean max_tokens (1: prefill only, exactly)
    trace: str | None = None
    input_lens_from: str | None = None  # random dataset: prompt lengths drawn from this trace's, clamped
    time_scale: float = 1.0
    max_input_len: int = 256
    max_output_len: int = 1  # trace: GeneratedTokens clamped to this (1: prefill only)
    ignore_eos: bool = False  # accepted for vLLM's command lines; not sent (the model has no EOS)
    goodput: dict[str, float] | None = None  # metric -> limit in ms
    percentile_metrics: list[str] = field(default_factory=lambda: list(report.DEFAULT_METRICS))
    metric_percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    seed: int = 0
    json_out: str | None = None
    timeout_s: float = 120.0
    disable_tqdm: bool = False
    stream: bool = True  # completions only: server-sent events, TTFT at the first chunk (as vLLM)
    headers: dict[str, str] = field(default_factory=dict)  # extra HTTP headers on every request
    ready_check_timeout_s: float = 0.0  # retry GET /v1/models this long; 0: ask once
    ready_state: str | None = None  # with a ready check: also wait until /ready names this state
    num_warmups: int = 0  # requests sent and awaited before the measured run, not counted
    save_result: bool = False  # write the result JSON under vLLM's file name (result.save_paths)
    result_dir: str | None = None  # with save_result: the folder (created if needed)
    result_filename: str | None = None  # with save_result: the file name instead of the default
    metadata: dict[str, str] = field(default_factory=dict)  # added to the result JSON's top level
    label: str | None = None  # recorded, and the file name's prefix instead of the backend

    def validate(self) -> None:
        """Raise ValueError with a readable reason for a configuration that cannot run."""
        self._validate_load()
        self._validate_dataset()
        self._validate_results()

    def _validate_load(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"the endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        arrivals.validate(self.request_rate, self.burstiness)
        _check(self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be >= 1")
        _check(self.num_prompts is None or self.num_prompts >= 1, "--num-prompts must be >= 1")
        _check(self.duration_s is None or self.duration_s > 0, "--duration must be > 0")
        _check(self.num_prompts is not None or self.duration_s is not None, "give --num-prompts or --duration")
        _check(self.timeout_s > 0, "--timeout must be > 0")
        _check(self.seed >= 0, "--seed must be >= 0")
        _check(self.num_warmups >= 0, "--num-warmups must be >= 0")
        _check(
            math.isfinite(self.ready_check_timeout_s) and self.ready_check_timeout_s >= 0,
            "--ready-check-timeout-sec must be >= 0",
        )
        for name, value in self.headers.items():
            try:
                check_header(name, value)
            except ValueError as exc:
                raise ValueError(f"--header: {exc}") from None

    def _validate_dataset(self) -> None:
        if self.dataset == "random":
            datasets.length_range(self.input_len, self.range_ratio)
            datasets.output_range(self.output_len, self.range_ratio)
            # Everything at once, for as long as the duration, with no cap: an endless burst.
            endless = self.num_prompts is None and math.isinf(self.request_rate) and self.max_concurrency is None
            _check(not endless, "--duration with an infinite --request-rate needs --max-concurrency (or a finite rate)")
        elif self.dataset == "trace":
            _check(self.trace is not None, "the trace dataset needs --trace FILE")
            _check(math.isfinite(self.time_scale) and self.time_scale > 0, "--trace-speedup must be > 0")
            _check(self.max_input_len >= 1, "--max-input-len must be >= 1")
            _check(self.max_output_len >= 1, "--max-output-len must be >= 1")
        else:
            raise ValueError(f"unknown dataset {self.dataset!r}: choose random or trace")
        decodes = self.output_len > 1 if self.dataset == "random" else self.max_output_len > 1
        _check(
            not decodes or self.endpoint == "completions",
            "/v1/prefill answers one token: --random-output-len and --max-output-len above 1 need /v1/completions",
        )

    def _validate_results(self) -> None:
        for metric in self.percentile_metrics:
            _check(metric in report.METRICS, f"unknown metric {metric!r}; choose from {', '.join(report.METRICS)}")
        for metric in self.goodput or {}:
            choices = ", ".join(report.GOODPUT_METRICS)
            _check(metric in report.GOODPUT_METRICS, f"unknown goodput metric {metric!r}; choose from {choices}")
        _check(
            "tpot" not in (self.goodput or {}) or self.stream or self.endpoint != "completions",
            "--goodput tpot needs a streamed answer: with --no-stream the first token's time is not seen",
        )
        _check(all(0 <= p <= 100 for p in self.metric_percentiles), "percentiles must be within 0..100")
        if self.json_out is not None:
            # Checked before the run, so a typo does not cost the results at the end of it.
            parent = Path(self.json_out).parent
            _check(parent.is_dir(), f"--json-out: the directory {parent} does not exist")
        for value, flag in [(self.result_dir, "--result-dir"), (self.result_filename, "--result-filename")]:
            _check(value is None or self.save_result, f"{flag} applies only with --save-result")
            _check(value != "", f"{flag} must not be empty")
        _check(all(key.strip() for key in self.metadata), "--metadata: a key must not be empty")

    def describe(self) -> dict[str, Any]:
        """The configuration as recorded with the results: JSON-safe, and without the API key."""
        d = asdict(self)
        for key in NOT_RECORDED:
            del d[key]
        # "duration" in the results is the measured duration; the limit gets its own name.
        d["duration_limit_s"] = d.pop("duration_s")
        if self.endpoint != "completions":
            d["stream"] = None  # the native API does not stream
        # JSON has no infinity; "inf" is what vLLM writes too.
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        if self.dataset == "trace":
            for key in ("request_rate", "burstiness", "input_len", "range_ratio", "output_len"):
                d[key] = None  # not used: the trace decides arrivals and lengths
        else:
            d["trace"] = d["time_scale"] = d["max_output_len"] = None
            if self.input_lens_from is None:
                d["max_input_len"] = None
            else:
                d["input_len"] = d["range_ratio"] = None  # the trace's lengths instead
        return d


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
