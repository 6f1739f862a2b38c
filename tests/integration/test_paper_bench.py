"""bench/paper.py: a quick run prints its table and JSON line and leaves the documented pictures
(docs/paper/, drawn by a full run) alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import paper


def test_a_quick_run_draws_its_pictures_apart_from_the_documented_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    documented, quick = tmp_path / "docs-paper", tmp_path / "paper-quick"
    monkeypatch.setattr(paper, "PICTURES", documented)
    monkeypatch.setattr(paper, "QUICK_PICTURES", quick)
    # one point a sweep (its pictures and JSON are the subject, not the curves): a third of the time
    monkeypatch.setattr(paper, "QUICK", paper.Sweeps((5.0,), (40.0,), (4,)))
    assert paper.main(["--quick", "--iterations", "2"]) == 0
    assert sorted(p.name for p in quick.iterdir()) == ["bandwidth.png", "latency.png", "scale.png"]
    assert not documented.exists()
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["quick"] is True and last["speedup_vs_dp"]["atlas"] > 1


def test_too_few_iterations_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        paper.main(["--quick", "--iterations", "1"])
    assert e.value.code == 2
    assert "--iterations must be at least 2" in capsys.readouterr().err
