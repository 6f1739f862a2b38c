"""The run report: exact computations, the table's formatting, the written files, clear errors."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bubbletea.report import (
    ReportError,
    RunInfo,
    Span,
    Summary,
    load_run_folder,
    main,
    markdown_table,
    select_iterations,
    write_report,
)
from shared.figures.runstats import steady_window, union_length, worker_usage

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DASH = "\N{EN DASH}"  # a null metric
HEADER = (
    "| Run | Iteration (ms) | Bubble fraction | GPU utilization | Prefill tok/s | Bubble fill | TTFT p50 (ms) "
    "| TTFT p99 (ms) | TTFT <= 1 s, of sent | Training slowdown (%) | Requests lost |"
)


def span(kind: str, start: float, end: float, *, replica: int = 0, stage: int = 0, it: int = 0) -> Span:
    return Span(replica=replica, stage=stage, iteration=it, kind=kind, start=start, end=end)


# --- utilization -----------------------------------------------------------------------------

# Times are multiples of 1/4 so every sum is exact in binary floating point.
SPANS = [
    # r0s0: fwd and bwd overlap (0..1.5 is 1.5 s, not 2); a prefill inside a wait; one half over bwd.
    span("fwd", 0.0, 1.0),
    span("bwd", 0.5, 1.5),
    span("wait", 1.5, 3.0),
    span("prefill", 2.0, 2.5),
    span("prefill", 1.25, 1.75),  # 1.25..1.5 is already training: only 0.25 s counts as prefill
    span("step", 3.0, 3.25),
    # r0s1: a long wait, two overlapping prefills in it, then compute.
    span("wait", 0.0, 2.0, stage=1),
    span("prefill", 0.5, 1.0, stage=1),
    span("prefill", 0.75, 1.25, stage=1),
    span("fwd", 2.0, 2.5, stage=1),
    span("allreduce", 3.5, 4.0, stage=1),
    # r1s0: an unknown kind overlapping a fwd counts as "other" for its uncovered part only.
    span("checkpoint", 0.0, 0.5, replica=1),
    span("fwd", 0.25, 0.75, replica=1),
]


def test_utilization_full_window_resolves_overlaps() -> None:
    usage = worker_usage(SPANS)
    assert list(usage) == ["r0s0", "r1s0", "r0s1"]  # stage, then replica
    assert usage["r0s0"] == {
        "training": 1.75,
        "prefill": 0.75,
        "other": 0.0,
        "idle": 1.5,
        "wait": 1.5,
        "filled": 0.75,
        "total": 4.0,
    }
    assert usage["r0s1"] == {
        "training": 1.0,
        "prefill": 0.75,
        "other": 0.0,
        "idle": 2.25,
        "wait": 2.0,
        "filled": 0.75,
        "total": 4.0,
    }
    assert usage["r1s0"] == {
        "training": 0.5,
        "prefill": 0.0,
        "other": 0.25,
        "idle": 3.25,
        "wait": 0.0,
        "filled": 0.0,
        "total": 4.0,
    }


def test_utilization_custom_window_clips_spans() -> None:
    usage = worker_usage(SPANS, window=(1.0, 3.0))
    assert usage["r0s0"] == {
        "training": 0.5,
        "prefill": 0.75,
        "other": 0.0,
        "idle": 0.75,
        "wait": 1.5,
        "filled": 0.75,
        "total": 2.0,
    }
    assert usage["r0s1"] == {
        "training": 0.5,
        "prefill": 0.25,
        "other": 0.0,
        "idle": 1.25,
        "wait": 1.0,
        "filled": 0.25,
        "total": 2.0,
    }
    assert usage["r1s0"] == {
        "training": 0.0,
        "prefill": 0.0,
        "other": 0.0,
        "idle": 2.0,
        "wait": 0.0,
        "filled": 0.0,
        "total": 2.0,
    }


def test_utilization_edge_cases() -> None:
    assert worker_usage([]) == {}
    with pytest.raises(ValueError, match="window ends before it starts"):
        worker_usage(SPANS, window=(2.0, 1.0))


def test_union_length() -> None:
    assert union_length([]) == 0.0
    assert union_length([(0.0, 1.0), (2.0, 3.0)]) == 2.0
    assert union_length([(2.0, 3.0), (0.0, 1.0), (0.5, 2.5), (1.0, 1.0)]) == 3.0


def test_select_iterations_skips_warmup_and_gaps() -> None:
    spans = [span("fwd", i, i + 0.5, it=i) for i in (0, 1, 2, 3, 4)]
    assert [s.iteration for s in select_iterations(spans, 1, 3)] == [1, 2, 3]
    gappy = [span("fwd", i, i + 0.5, it=i) for i in (0, 2, 5, 7)]
    assert [s.iteration for s in select_iterations(gappy, 1, 2)] == [2, 5]
    warmup_only = [span("fwd", 0, 1), span("bwd", 1, 2)]
    assert select_iterations(warmup_only, 1, 3) == warmup_only  # something is still drawn
    with pytest.raises(ValueError):
        select_iterations(spans, 1, 0)


def test_steady_window_excludes_warmup() -> None:
    spans = [span("fwd", 0.0, 5.0), span("wait", 4.0, 6.0, it=1), span("fwd", 6.0, 7.0, it=1)]
    assert steady_window(spans) == (4.0, 7.0)  # iteration 1 starts with its first span (a wait counts)
    assert steady_window(spans[:1]) == (0.0, 5.0)


# --- the table -------------------------------------------------------------------------------


def test_markdown_table_formats_each_kind_of_value() -> None:
    summary = Summary(
        runs=(
            RunInfo(
                "fair",
                "Fair | sharing",
                {
                    "iteration_ms": 533.14,
                    "bubble_fraction": 0.41,
                    "utilization": 0.5926,
                    "prefill_tokens_per_s": 1234.56,
                    "ttft_p50_ms": None,
                    "train_slowdown_pct": 2.26,
                    "requests_lost": 3.0,
                    "something_new": 7.0,  # unknown: not a column
                },
            ),
            RunInfo("empty", "No metrics"),
        )
    )
    assert markdown_table(summary).splitlines() == [
        HEADER,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| Fair \\| sharing | 533.1 | 41.0% | 59.3% | 1234.6 | {DASH} | {DASH} | {DASH} | {DASH} | 2.3 | 3 |",
        "| No metrics |" + f" {DASH} |" * 10,
    ]


# --- a synthetic run folder ------------------------------------------------------------------


# (stage, kind, start ms, end ms, microbatch) of one iteration
ITERATION = [
    (0, "fwd", 0, 10, 0),
    (0, "fwd", 10, 20, 1),
    (0, "wait", 20, 60, None),
    (0, "bwd", 60, 80, 1),
    (0, "bwd", 80, 90, 0),
    (1, "wait", 0, 20, None),
    (1, "fwd", 20, 30, 0),
    (1, "fwd", 30, 40, 1),
    (1, "bwd", 40, 60, 1),
    (1, "bwd", 60, 70, 0),
    (0, "step", 90, 95, None),
    (1, "step", 90, 95, None),
]
PREFILL = [(0, "prefill", 25, 55, None), (1, "prefill", 2, 18, None)]


def run_spans(prefill: bool, extra_kind: str | None = None) -> list[dict[str, Any]]:
    """2 workers (r0s0, r0s1) x 2 iterations of a 2-microbatch pipeline, 100 ms per iteration."""
    rows = ITERATION + (PREFILL if prefill else []) + ([(1, extra_kind, 70, 85, None)] if extra_kind else [])
    return [
        {
            "replica": 0,
            "stage": stage,
            "iteration": it,
            "span": kind,
            "start": 1763790000.0 + it * 0.1 + a / 1000,
            "end": 1763790000.0 + it * 0.1 + b / 1000,
            "microbatch": mb,
        }
        for it in range(2)
        for stage, kind, a, b, mb in rows
    ]


def make_run_folder(root: Path) -> Path:
    runs = [
        ("fair", "Fair sharing, BubbleTea off", run_spans(False), None),
        ("atlas", "Atlas, BubbleTea off", run_spans(False, extra_kind="checkpoint"), [12.0, 30.5]),
        ("bubbletea", "Atlas + BubbleTea", run_spans(True), [3.0, 8.0, 15.0, 900.0]),
    ]
    summary: dict[str, Any] = {"spec": "configs/demo.yaml", "created": "2026-11-22T05:00:00Z", "runs": []}
    for name, label, spans, ttfts in runs:
        summary["runs"].append({"name": name, "label": label, "metrics": {"iteration_ms": 100.0, "utilization": 0.5}})
        (root / name).mkdir(parents=True)
        (root / name / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
        if ttfts is not None:
            (root / name / "ttft_ms.json").write_text(json.dumps(ttfts))
    (root / "summary.json").write_text(json.dumps(summary))
    return root


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_write_report_writes_every_picture_and_links_them(tmp_path: Path) -> None:
    run_dir = make_run_folder(tmp_path / "run")
    written = write_report(run_dir)
    names = [p.name for p in written]
    assert names == [
        "timeline-fair.png",
        "timeline-atlas.png",
        "timeline-bubbletea.png",
        "utilization.png",
        "ttft.png",
        "table.md",
        "report.md",
        "dashboard.html",
        "dashboard-fair.html",
        "dashboard-atlas.html",
        "dashboard-bubbletea.html",
    ]
    assert all(p.parent == run_dir and p.is_file() for p in written)
    for p in written:
        if p.suffix == ".png":
            width, height = png_size(p)
            assert 1000 <= width <= 2000 and 250 <= height <= 2500, (p.name, width, height)
    report = (run_dir / "report.md").read_text()
    for p in written:
        if p.suffix == ".png":
            assert f"]({p.name})" in report
    table = markdown_table(load_run_folder(run_dir).summary)
    assert (run_dir / "table.md").read_text() == table
    assert table in report


def test_write_report_skips_pictures_with_nothing_to_show(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "only").mkdir()
    (run_dir / "only" / "spans.jsonl").write_text(json.dumps(run_spans(False)[0]) + "\n")
    (run_dir / "only" / "ttft_ms.json").write_text("[]")
    runs = [{"name": "only", "label": "Only"}, {"name": "absent", "label": "No folder at all"}]
    (run_dir / "summary.json").write_text(json.dumps({"runs": runs}))
    written = write_report(run_dir, tmp_path / "out")
    assert [p.name for p in written] == [
        "timeline-only.png",
        "utilization.png",
        "table.md",
        "report.md",
        "dashboard.html",
        "dashboard-only.html",
    ]
    assert "ttft.png" not in (tmp_path / "out" / "report.md").read_text()


def test_unknown_span_kind_is_other_not_a_crash(tmp_path: Path) -> None:
    """Counted as "other" here; drawn in grey by test_write_report_... (the atlas run has one)."""
    folder = load_run_folder(make_run_folder(tmp_path / "run"))
    spans = folder.spans["atlas"]
    assert any(s.kind == "checkpoint" for s in spans)
    usage = worker_usage(spans)
    assert usage["r0s1"]["other"] == pytest.approx(2 * 0.015, abs=1e-6)  # 70..85 ms, twice; epoch seconds
    assert usage["r0s0"]["other"] == 0.0


# --- errors and the command ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda d: None, "no such run folder"),
        (lambda d: d.mkdir(), "summary.json: missing"),
        (lambda d: (d.mkdir(), (d / "summary.json").write_text("{oops")), "summary.json: not valid JSON"),
        (lambda d: (d.mkdir(), (d / "summary.json").write_text('{"runs": {}}')), '"runs" must be a list'),
        (lambda d: (d.mkdir(), (d / "summary.json").write_text('{"runs": []}')), '"runs" is empty'),
        (
            lambda d: (d.mkdir(), (d / "summary.json").write_text('{"runs": [{"name": "a/b"}]}')),
            "must be a plain folder name",
        ),
        (
            lambda d: (
                d.mkdir(),
                (d / "summary.json").write_text('{"runs": [{"name": "a", "metrics": {"utilization": "high"}}]}'),
            ),
            'runs[0].metrics: "utilization" must be a number or null',
        ),
    ],
)
def test_bad_folders_raise_report_error_naming_the_problem(tmp_path: Path, setup: Any, expected: str) -> None:
    run_dir = tmp_path / "run"
    setup(run_dir)
    with pytest.raises(ReportError) as info:
        load_run_folder(run_dir)
    assert str(run_dir) in str(info.value) and expected in str(info.value)


def test_bad_run_files_name_the_file_and_line(tmp_path: Path) -> None:
    run_dir = make_run_folder(tmp_path / "run")
    spans_file = run_dir / "atlas" / "spans.jsonl"
    lines = spans_file.read_text().splitlines()
    spans_file.write_text("\n".join([lines[0], '{"replica": 0, "stage": 0}', *lines[2:]]))
    with pytest.raises(ReportError, match=r"atlas/spans.jsonl: line 2: \"iteration\" must be an integer"):
        load_run_folder(run_dir)
    spans_file.write_text(lines[0] + "\nnot json\n")
    with pytest.raises(ReportError, match=r"atlas/spans.jsonl: line 2: not valid JSON"):
        load_run_folder(run_dir)
    spans_file.write_text("\n".join(lines))
    (run_dir / "bubbletea" / "ttft_ms.json").write_text('{"p50": 3}')
    with pytest.raises(ReportError, match=r"bubbletea/ttft_ms.json: expected a JSON list"):
        load_run_folder(run_dir)


def test_main_prints_table_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_run_folder(tmp_path / "run")
    (run_dir / "bubbletea" / "spans.jsonl").unlink()  # keep the test light: two timelines
    (run_dir / "atlas" / "spans.jsonl").unlink()
    assert main([str(run_dir), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert HEADER in out and "wrote:" in out and str(tmp_path / "out" / "report.md") in out


def test_main_reports_errors_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bubbletea: error: ") and "missing" in err


def test_main_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib is the `report` extra (the service image leaves it out): its absence is one line."""
    run_dir = make_run_folder(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main([str(run_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bubbletea: error: ") and "bubbletea[report]" in err
    assert not (tmp_path / "out").exists()


def test_module_entry_point_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bubbletea.report", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: bubbletea report") and "--out DIR" in result.stdout


def test_timelines_and_ttfts_are_drawn_on_the_device_clock_when_k_is_known() -> None:
    """The table gives device ms; so do the pictures, saying the clock and k (issue 51)."""
    from bubbletea.report.plots import timeline_figure, ttft_figure

    spans = [span("fwd", 100.0, 100.4), span("bwd", 100.4, 101.2), span("fwd", 100.0, 100.8, stage=1)]
    on_device = timeline_figure(spans, "t", time_scale=4.0).axes[0]
    assert "device ms (real ms / k, k = 4)" in on_device.get_xlabel()
    assert on_device.get_xlim()[1] == pytest.approx(1200 / 4, rel=0.02)  # 1.2 real s = 300 device ms
    on_host = timeline_figure(spans, "t").axes[0]
    assert "host ms" in on_host.get_xlabel() and on_host.get_xlim()[1] == pytest.approx(1200, rel=0.02)
    ttft = ttft_figure([("run", [40.0, 80.0, 120.0])], time_scale=4.0).axes[0]
    assert "device ms (real ms / k, k = 4)" in ttft.get_xlabel()
    assert any("p50 20.0 ms" in t.get_text() for t in ttft.get_legend().get_texts())


def test_the_run_page_is_written_self_contained_with_the_run_inlined(tmp_path: Path) -> None:
    """dashboard.html: the live page's drawing, the run with the most prefill inlined, no external URL."""
    run_dir = make_run_folder(tmp_path / "run")
    write_report(run_dir)
    html = (run_dir / "dashboard.html").read_text()
    assert html == (run_dir / "dashboard-bubbletea.html").read_text()
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", html)
    boot = json.loads(html.split('<script id="bt-data" type="application/json">')[1].split("</script>")[0])
    kinds = {seg[2] for seg in boot["view"]["segments"]}
    assert {"compute", "bubble", "prefill"} <= kinds
    assert boot["view"]["run"] == "Atlas + BubbleTea"
