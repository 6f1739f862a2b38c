"""Figures the documents state twice agree, and the ones derived from others are derived right:
the README's demo table is docs/benchmarks.md's newest demo run, its summary row says the same,
and every "vs fair" ratio is the iterations' quotient."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
RUNS = ("fair sharing", "Atlas (temporal", "Atlas + BubbleTea")


def demo_rows(text: str) -> dict[str, tuple[float, str]]:
    """The first table in `text` with the three demo runs: run -> (iteration, vs fair)."""
    rows: dict[str, tuple[float, str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and any(cells[0].startswith(r) for r in RUNS):
            name = next(r for r in RUNS if cells[0].startswith(r))
            if name in rows:
                break  # a second table: the older run
            rows[name] = (float(cells[1]), cells[2])
        elif rows and len(rows) == len(RUNS):
            break
    return rows


def newest_demo_section() -> str:
    start = BENCHMARKS.index("## The demo (`make demo`")
    return BENCHMARKS[start : BENCHMARKS.index("\n## ", start + 1)]


def test_the_readme_shows_the_newest_demo_run_of_the_benchmarks() -> None:
    readme, bench = demo_rows(README), demo_rows(newest_demo_section())
    assert len(readme) == len(RUNS) and readme == bench


def test_the_summary_row_names_the_same_iterations() -> None:
    row = next(line for line in BENCHMARKS.splitlines() if line.startswith("| [the demo]"))
    iterations = [float(x) for x in re.search(r"iteration ([\d.]+) / ([\d.]+) / ([\d.]+)", row).groups()]  # type: ignore[union-attr]
    assert iterations == [demo_rows(newest_demo_section())[r][0] for r in RUNS]
    date = re.search(r"\(`make demo`, (\d{4}-\d\d-\d\d)\)", newest_demo_section()).group(1)  # type: ignore[union-attr]
    assert date in row


@pytest.mark.parametrize("text", [README, BENCHMARKS], ids=["README", "benchmarks"])
def test_every_vs_fair_ratio_is_the_iterations_quotient(text: str) -> None:
    rows = demo_rows(text)
    fair = rows["fair sharing"][0]
    for iteration, ratio in rows.values():
        assert ratio == f"{fair / iteration:.2f}x", (iteration, ratio)


def test_the_test_tiers_are_named_the_same_everywhere() -> None:
    """README, docs/testing.md and `make help` name the tiers `make test` runs: the folders of tests/
    but those the Makefile leaves out."""
    makefile = (ROOT / "Makefile").read_text()
    ignored = set(re.findall(r"--ignore=tests/(\w+)", makefile))
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    run = sorted(folders - ignored)
    said = "the unit, integration, e2e, browser, compose and deploy tiers"
    assert sorted(["unit", "integration", "e2e", "browser", "compose", "deploy"]) == run, run
    testing = (ROOT / "docs" / "testing.md").read_text()
    assert said in " ".join(README.split()) and said in " ".join(testing.split())
    assert "unit, integration, e2e, browser, compose and deploy tiers" in makefile
    assert ignored == {"vllm", "slurm"}
