"""The traces shipped under loadgen/traces/ (`loadgen.tracegen`): read by the load generator's own
reader, regenerated exactly from their seed, and within stated bounds of the statistics of Azure's
published LLM inference traces (2023) that the generator documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadgen.datasets import plan_trace, read_trace
from loadgen.tracegen import CODE, CONV, KINDS, PERCENTILES, Kind, rows
from loadgen.tracegen import main as tracegen_main

#: Bounds on the gaps' coefficient of variation of ten minutes of each kind (the published traces:
#: 1.09 over the hour and 1.0 to 1.1 in each ten minutes; 13.2 over the hour and 9 to 17.5).
GAP_CV = {"conv": (0.95, 1.25), "code": (6.0, 26.0)}
#: The medians the Splitwise paper gives (prompt, output): conversation 1,020 and 129; coding about
#: 1,500 (1,469 in the published trace) and 13.
MEDIANS = {"conv": (1020, 129), "code": (1500, 13)}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_the_shipped_trace_is_small_and_regenerates_exactly(kind: Kind) -> None:
    assert kind.file.stat().st_size < 200_000
    assert kind.file.read_text(encoding="utf-8").splitlines() == rows(kind)


def test_the_generator_writes_both_traces(tmp_path: Path) -> None:
    assert tracegen_main(["--out", str(tmp_path)]) == 0
    for kind in KINDS:
        assert (tmp_path / kind.file.name).read_bytes() == kind.file.read_bytes()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_the_shipped_trace_has_the_published_statistics(kind: Kind) -> None:
    trace = read_trace(kind.file)  # the reader `loadgen --trace` uses
    offsets = np.array([r.offset_s for r in trace])
    ctx = np.array([r.context_tokens for r in trace])
    gen = np.array([r.generated_tokens for r in trace], dtype=float)
    assert 1_000 <= len(trace) <= 5_000 and offsets[-1] <= 600
    assert abs(len(trace) / 600 / kind.rate_per_s - 1) < 0.15  # requests per second, within 15%
    gaps = np.diff(offsets)
    lo, hi = GAP_CV[kind.name]
    assert lo <= gaps.std() / gaps.mean() <= hi
    want_ctx, want_gen = MEDIANS[kind.name]
    assert abs(np.median(ctx) / want_ctx - 1) < 0.1 and abs(np.median(gen) / want_gen - 1) < 0.1
    for p in (5, 25, 75, 95):  # the quantiles matched, each within 15%
        i = PERCENTILES.index(p)
        assert abs(np.percentile(ctx, p) / kind.context_q[i] - 1) < 0.15, ("ContextTokens", p)
        assert abs(np.percentile(gen, p) / kind.generated_q[i] - 1) < 0.15, ("GeneratedTokens", p)
    assert ctx.min() >= kind.context_q[0] and ctx.max() <= kind.context_q[-1]
    assert abs(np.corrcoef(np.log(ctx), np.log(gen))[0, 1]) < 0.1  # drawn independently, as published


def test_the_documented_replay_plans_as_the_docs_say() -> None:
    """docs/loadgen.md: ten minutes of the conversation trace in 60 s at --time-scale 10, most
    prompts clamped to 256 tokens."""
    plan = plan_trace(read_trace(CONV.file), time_scale=10, duration_s=60, max_input_len=256)
    assert 3_000 <= len(plan.offsets_s) <= 3_500 and max(plan.offsets_s) <= 60
    assert plan.clamped > len(plan.offsets_s) / 2
    code = plan_trace(read_trace(CODE.file), max_output_len=64)
    assert max(code.output_lens) == 64 and min(code.output_lens) >= 1
