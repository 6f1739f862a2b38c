"""Reading a run folder (the demo's output) into typed records, with errors that name the file.

The run folder is the contract between the demo, which writes it, and the report, which draws it
(docs/report.md). Everything is validated here, once, so the computations and the pictures can
trust their inputs and a broken folder is reported as "which file, what is wrong" instead of a
traceback from deep inside matplotlib.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.figures.runstats import TRAINING_KINDS
from shared.policies.spans import Span

SUMMARY_FILE = "summary.json"
SPANS_FILE = "spans.jsonl"
TTFT_FILE = "ttft_ms.json"

#: Span kinds the report knows how to draw; any other kind is drawn in grey and counted as "other".
KNOWN_KINDS = TRAINING_KINDS | {"wait", "prefill"}


@dataclass(frozen=True, slots=True)
class MetricColumn:
    """A metric summary.json may carry, its table header, and how its value is written."""

    key: str
    header: str
    unit: str  # "ms", "fraction" (shown as %), "rate", "pct" (already a percentage) or "count"


#: The known metrics, in table column order. Other keys in summary.json are kept but not shown.
METRIC_COLUMNS: tuple[MetricColumn, ...] = (
    MetricColumn("iteration_ms", "Iteration (ms)", "ms"),
    MetricColumn("bubble_fraction", "Bubble fraction", "fraction"),
    MetricColumn("utilization", "GPU utilization", "fraction"),
    MetricColumn("prefill_tokens_per_s", "Prefill tok/s", "rate"),
    MetricColumn("bubble_fill_ratio", "Bubble fill", "fraction"),
    MetricColumn("ttft_p50_ms", "TTFT p50 (ms)", "ms"),
    MetricColumn("ttft_p99_ms", "TTFT p99 (ms)", "ms"),
    MetricColumn("slo_attainment", "TTFT <= 1 s, of sent", "fraction"),
    MetricColumn("train_slowdown_pct", "Training slowdown (%)", "pct"),
    MetricColumn("requests_lost", "Requests lost", "count"),
)


class ReportError(ValueError):
    """A run folder that cannot be reported on; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One configuration's entry in summary.json."""

    name: str
    label: str
    metrics: dict[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Summary:
    """summary.json: which spec was run, when, and the headline metrics of each configuration."""

    runs: tuple[RunInfo, ...]
    spec: str | None = None
    created: str | None = None
    #: k: one device ms lasted this many real ms in the runs (None: not recorded, e.g. the simulator's)
    time_scale: float | None = None


@dataclass(frozen=True, slots=True)
class RunFolder:
    """A whole run folder. Runs without spans.jsonl / ttft_ms.json have empty lists, so callers
    never need to distinguish "missing" from "empty" (both mean: nothing to draw)."""

    path: Path
    summary: Summary
    spans: dict[str, list[Span]]
    ttfts_ms: dict[str, list[float]]


# --- loading ---------------------------------------------------------------------------------


def load_run_folder(path: str | Path) -> RunFolder:
    """Read summary.json and, for every run it lists, the optional spans and TTFTs."""
    root = Path(path)
    if not root.exists():
        raise ReportError(f"{root}: no such run folder")
    if not root.is_dir():
        raise ReportError(f"{root}: not a folder (expected a run folder containing {SUMMARY_FILE})")
    summary = load_summary(root / SUMMARY_FILE)
    spans = {run.name: load_spans(root / run.name / SPANS_FILE) for run in summary.runs}
    ttfts = {run.name: load_ttfts(root / run.name / TTFT_FILE) for run in summary.runs}
    return RunFolder(path=root, summary=summary, spans=spans, ttfts_ms=ttfts)


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path}: cannot be read: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None


def load_summary(path: Path) -> Summary:
    """Parse summary.json; the run names become folder and file names, so they are checked too."""
    if not path.exists():
        raise ReportError(f"{path}: missing (is {path.parent} a run folder written by the demo?)")
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object at the top level, got {_json_type(data)}")
    raw_runs = data.get("runs")
    if not isinstance(raw_runs, list):
        raise ReportError(f'{path}: "runs" must be a list of runs, got {_json_type(raw_runs)}')
    if not raw_runs:
        raise ReportError(f'{path}: "runs" is empty, there is nothing to report')
    runs = tuple(_parse_run(path, i, r) for i, r in enumerate(raw_runs))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ReportError(f"{path}: duplicate run names: {', '.join(duplicates)}")
    return Summary(
        runs=runs,
        spec=_optional_str(path, data, "spec"),
        created=_optional_str(path, data, "created"),
        time_scale=_optional_scale(path, data),
    )


def _optional_scale(path: Path, data: dict[str, Any]) -> float | None:
    k = data.get("device_time_scale")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int | float) or not k > 0:
        raise ReportError(f'{path}: "device_time_scale" must be a number above 0, got {k!r}')
    return float(k)


def _optional_str(path: Path, data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ReportError(f'{path}: "{key}" must be a string, got {_json_type(value)}')
    return value


def _parse_run(path: Path, index: int, raw: Any) -> RunInfo:
    where = f"{path}: runs[{index}]"
    if not isinstance(raw, dict):
        raise ReportError(f"{where}: expected an object, got {_json_type(raw)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ReportError(f'{where}: "name" must be a non-empty string')
    if name in (".", "..") or "/" in name or "\\" in name:
        raise ReportError(f'{where}: "name" {name!r} must be a plain folder name')
    label = raw.get("label", name)
    if not isinstance(label, str):
        raise ReportError(f'{where}: "label" must be a string, got {_json_type(label)}')
    raw_metrics = raw.get("metrics", {})
    if raw_metrics is None:
        raw_metrics = {}
    if not isinstance(raw_metrics, dict):
        raise ReportError(f'{where}: "metrics" must be an object, got {_json_type(raw_metrics)}')
    return RunInfo(name=name, label=label or name, metrics=_parse_metrics(f"{where}.metrics", raw_metrics))


def _parse_metrics(where: str, raw: dict[str, Any]) -> dict[str, float | None]:
    """Numbers and nulls are kept; a known metric of another type is an error, while unknown keys
    of other types are dropped (the demo may add richer entries the report does not show)."""
    known = {c.key for c in METRIC_COLUMNS}
    metrics: dict[str, float | None] = {}
    for key, value in raw.items():
        if value is None or (_is_number(value)):
            metrics[key] = None if value is None else float(value)
        elif key in known:
            raise ReportError(f'{where}: "{key}" must be a number or null, got {_json_type(value)}')
    return metrics


def load_spans(path: Path) -> list[Span]:
    """Parse spans.jsonl (one object per line, blank lines allowed); a missing file is no spans."""
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path}: cannot be read: {e}") from None
    spans = []
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            spans.append(_parse_span(f"{path}: line {lineno}", line))
    return spans


def _parse_span(where: str, line: str) -> Span:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ReportError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(raw, dict):
        raise ReportError(f"{where}: expected a JSON object, got {_json_type(raw)}")
    ints = {key: _require_int(where, raw, key) for key in ("replica", "stage", "iteration")}
    kind = raw.get("span")
    if not isinstance(kind, str) or not kind:
        raise ReportError(f'{where}: "span" must be a non-empty string (fwd, bwd, wait, ...)')
    start, end = _require_number(where, raw, "start"), _require_number(where, raw, "end")
    if end < start:
        raise ReportError(f"{where}: ends before it starts (start {start}, end {end})")
    mb = raw.get("microbatch")
    if mb is not None and not _is_int(mb):
        raise ReportError(f'{where}: "microbatch" must be an integer or null, got {_json_type(mb)}')
    return Span(
        replica=ints["replica"],
        stage=ints["stage"],
        iteration=ints["iteration"],
        kind=kind,
        start=start,
        end=end,
        microbatch=mb if mb is not None and mb >= 0 else None,  # the workers write -1 for "none"
    )


def load_ttfts(path: Path) -> list[float]:
    """Parse ttft_ms.json (a JSON list of milliseconds); a missing file is no answered requests."""
    if not path.exists():
        return []
    data = _read_json(path)
    if not isinstance(data, list):
        raise ReportError(f"{path}: expected a JSON list of milliseconds, got {_json_type(data)}")
    bad = next((i for i, v in enumerate(data) if not _is_number(v) or not math.isfinite(v) or v < 0), None)
    if bad is not None:
        raise ReportError(f"{path}: item {bad} is {data[bad]!r}, expected a finite number of milliseconds >= 0")
    return [float(v) for v in data]


# --- small validators ------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _require_int(where: str, raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReportError(f'{where}: "{key}" must be an integer, got {_json_type(value)}')
    return value


def _require_number(where: str, raw: dict[str, Any], key: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ReportError(f'{where}: "{key}" must be a finite number of seconds, got {_json_type(value)}')
    return float(value)


def _json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages a config author understands."""
    if value is None:
        return "null (or nothing)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
