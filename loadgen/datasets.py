"""What is sent: random token-id prompts, or prompt lengths and arrival times from a trace (pure).

The served model is byte-level (a vocabulary of 256), so a prompt of N tokens is N ids in 0..255
and the content does not matter to the cost of a prefill: only the length does. Both datasets
therefore send random ids; a trace contributes lengths and timing, not text. Each request also
asks for a number of output tokens (`max_tokens`): 1 by default (prefill only), drawn like the
prompt lengths with --random-output-len, or the trace's GeneratedTokens clamped to --max-output-len.

The trace format is Azure's public LLM inference trace (AzurePublicDataset):

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:17:03.9799600,4808,10

The timestamps carry 7 fractional digits (100 ns ticks), which `datetime.strptime` ("%f" takes at
most 6) refuses, so they are parsed here with a regular expression into integer nanoseconds:
offsets between requests are then exact, with no float rounding of large epoch values.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np

#: Token ids are bytes: the served model's vocabulary is 256.
VOCAB = 256

_TIMESTAMP = re.compile(r"^\s*(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d+))?Z?\s*$")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line at fault."""


class TraceRequest(NamedTuple):
    """One request of a trace: when it arrives (seconds after the trace's first request), its
    prompt length in tokens and the tokens it generated, as recorded (before any clamping; None
    when the trace has no GeneratedTokens column)."""

    offset_s: float
    context_tokens: int
    generated_tokens: int | None = None


@dataclass(frozen=True)
class TracePlan:
    """The part of a trace that will be replayed, ready to send."""

    offsets_s: list[float]  # send times after the start, already divided by the time scale
    lengths: list[int]  # prompt lengths, clamped to [1, max_input_len]
    clamped: int  # how many prompts were longer than max_input_len and were cut
    output_lens: list[int] = field(default_factory=list)  # max_tokens: generated, in [1, max_output_len]


# --- random prompts ----------------------------------------------------------------------------


def length_range(input_len: int, range_ratio: float, what: str = "input length") -> tuple[int, int]:
    """The inclusive range prompt lengths are drawn from, as `vllm bench serve --dataset-name random`
    computes it: [floor(input_len * (1 - range_ratio)), ceil(input_len * (1 + range_ratio))], with
    0 <= range_ratio < 1. One difference: the low end is at least 1 token (an empty prompt is not a
    request the server accepts; vLLM refuses such a range instead). Output lengths use the same
    range (`output_range`), whose low end vLLM also raises to 1."""
    if input_len < 1:
        raise ValueError(f"the {what} must be >= 1, got {input_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"the range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(input_len * (1 - range_ratio)))
    hi = max(lo, math.ceil(input_len * (1 + range_ratio)))
    return lo, hi


def output_range(output_len: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive range of `max_tokens` for --random-output-len: `length_range`, as vLLM draws
    output lengths, except that 1 (the default: prefill only) is always exactly 1, so a prefill-only
    server keeps working with any --random-range-ratio."""
    if output_len == 1:
        return 1, 1
    return length_range(output_len, range_ratio, "output length")


def random_output_lens(output_len: int, range_ratio: float, rng: np.random.Generator) -> Iterator[int]:
    """An endless stream of `max_tokens`, uniform in `output_range` (no draw at all for 1)."""
    lo, hi = output_range(output_len, range_ratio)
    while True:
        yield lo if lo == hi else int(rng.integers(lo, hi + 1))


def random_tokens(length: int, rng: np.random.Generator) -> list[int]:
    """A prompt of `length` random token ids (plain ints: they go into JSON)."""
    return rng.integers(0, VOCAB, size=length).tolist()


def random_prompts(input_len: int, range_ratio: float, rng: np.random.Generator) -> Iterator[list[int]]:
    """An endless stream of prompts with lengths uniform in `length_range`. Lazy, because a
    --duration run does not know in advance how many prompts it will send."""
    lo, hi = length_range(input_len, range_ratio)
    while True:
        yield random_tokens(int(rng.integers(lo, hi + 1)), rng)


def prompts_of_lengths(lengths: Sequence[int], rng: np.random.Generator) -> Iterator[list[int]]:
    """An endless stream of prompts whose lengths are drawn from `lengths` (with replacement)."""
    if not lengths:
        raise ValueError("no prompt lengths to draw from")
    while True:
        yield random_tokens(int(lengths[int(rng.integers(0, len(lengths)))]), rng)


# --- traces ------------------------------------------------------------------------------------


def parse_timestamp_ns(text: str) -> int:
    """'2023-11-16 18:17:03.9799600' -> nanoseconds since the epoch (the time is taken as UTC:
    only differences matter). Any number of fractional digits is accepted; beyond 9 they are
    truncated. Raises ValueError on anything else."""
    m = _TIMESTAMP.match(text)
    if m is None:
        raise ValueError(f"not a timestamp like '2023-11-16 18:17:03.9799600': {text!r}")
    try:
        # Aware UTC, so local daylight-saving shifts can never distort an offset.
        year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
        when = datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    except ValueError as exc:  # e.g. month 13, February 30
        raise ValueError(f"{exc}: {text!r}") from None
    seconds = (when - _EPOCH) // timedelta(seconds=1)  # integer arithmetic: exact
    fraction = (m.group(7) or "")[:9].ljust(9, "0")
    return seconds * 1_000_000_000 + int(fraction)


def _column(header: list[str], name: str, path: Path) -> int:
    names = [h.strip().lower() for h in header]
    if name.lower() not in names:
        raise TraceError(f"{path}:1: the header has no {name} column (expected TIMESTAMP,ContextTokens,...)")
    return names.index(name.lower())


def _count(row: list[str], col: int, name: str, where: str) -> int:
    try:
        tokens = int(row[col].strip())
    except ValueError:
        raise TraceError(f"{where}: {name} must be an integer, got {row[col]!r}") from None
    if tokens < 0:
        raise TraceError(f"{where}: {name} must be >= 0, got {tokens}")
    return tokens


def _parse_row(
    row: list[str], ts_col: int, ctx_col: int, gen_col: int | None, where: str
) -> tuple[int, int, int | None]:
    needed = max(ts_col, ctx_col, -1 if gen_col is None else gen_col) + 1
    if len(row) < needed:
        raise TraceError(f"{where}: expected at least {needed} fields, got {len(row)}: {row}")
    try:
        ns = parse_timestamp_ns(row[ts_col])
    except ValueError as exc:
        raise TraceError(f"{where}: {exc}") from None
    tokens = _count(row, ctx_col, "ContextTokens", where)
    generated = None if gen_col is None else _count(row, gen_col, "GeneratedTokens", where)
    return ns, tokens, generated


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read an Azure-format trace CSV: one TraceRequest per row, offsets relative to the earliest
    timestamp, in arrival order. Columns are found by name (case-insensitive), so extra or
    reordered columns are fine; GeneratedTokens may be missing (then None). Blank lines are
    skipped; anything malformed raises TraceError naming the line."""
    path = Path(path)
    rows: list[tuple[int, int, int | None]] = []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{path}: the file is empty")
            ts_col, ctx_col = _column(header, "TIMESTAMP", path), _column(header, "ContextTokens", path)
            names = [h.strip().lower() for h in header]
            gen_col = names.index("generatedtokens") if "generatedtokens" in names else None
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue
                rows.append(_parse_row(row, ts_col, ctx_col, gen_col, f"{path}:{reader.line_num}"))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"cannot read the trace {path}: {exc}") from None
    if not rows:
        raise TraceError(f"{path}: the trace has a header but no requests")
    # The published traces are in time order; a stable sort costs little and makes a shuffled
    # or concatenated file replay correctly instead of producing negative offsets.
    rows.sort(key=lambda r: r[0])
    first = rows[0][0]
    return [TraceRequest((ns - first) / 1e9, tokens, generated) for ns, tokens, generated in rows]


def trace_lengths(trace: Sequence[TraceRequest], max_input_len: int) -> list[int]:
    """The trace's prompt lengths, each clamped to [1, max_input_len] (`--input-lens-from`)."""
    if max_input_len < 1:
        raise ValueError(f"the maximum input length must be >= 1, got {max_input_len}")
    return [min(max(req.context_tokens, 1), max_input_len) for req in trace]


def plan_trace(
    trace: list[TraceRequest],
    *,
    time_scale: float = 1.0,
    max_input_len: int = 256,
    duration_s: float | None = None,
    limit: int | None = None,
    max_output_len: int = 1,
) -> TracePlan:
    """Select and shape the part of a trace to replay.

    Offsets are divided by `time_scale` (10 = replay ten times faster). Only requests whose
    scaled offset is within `duration_s` are kept, then at most `limit` of them. Lengths are
    clamped to [1, max_input_len]: the server refuses longer prompts, and a replay is meant to
    reproduce the arrival pattern, so cutting (and counting the cuts) beats sending requests that
    can only fail. A recorded length of 0 becomes 1, since an empty prompt is not a request.
    Output lengths (`max_tokens`) are the recorded GeneratedTokens clamped to [1, max_output_len]:
    1 by default (prefill only); above 1 the trace must have the column (TraceError otherwise).
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"the time scale must be a finite number > 0, got {time_scale}")
    if max_input_len < 1:
        raise ValueError(f"the maximum input length must be >= 1, got {max_input_len}")
    if max_output_len < 1:
        raise ValueError(f"the maximum output length must be >= 1, got {max_output_len}")
    offsets: list[float] = []
    lengths: list[int] = []
    output_lens: list[int] = []
    clamped = 0
    for req in trace:
        if limit is not None and len(offsets) >= limit:
            break
        offset = req.offset_s / time_scale
        if duration_s is not None and offset >= duration_s:
            break  # the trace is in time order: nothing later fits either
        if req.context_tokens > max_input_len:
            clamped += 1
        offsets.append(offset)
        lengths.append(min(max(req.context_tokens, 1), max_input_len))
        if max_output_len == 1:
            output_lens.append(1)
        elif req.generated_tokens is None:
            raise TraceError("the trace has no GeneratedTokens column, which --max-output-len above 1 replays")
        else:
            output_lens.append(min(max(req.generated_tokens, 1), max_output_len))
    return TracePlan(offsets, lengths, clamped, output_lens)
