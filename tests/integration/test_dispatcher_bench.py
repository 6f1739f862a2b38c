"""bench/dispatcher.py: one tiny case drives a real dispatcher process with emulated workers and
prints one JSON line with its capacity figures; every request it sent is answered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_case_answers_what_it_sends_and_reports_every_figure() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dispatcher.py"), "--replicas", "1", "--rate", "100", "--seconds", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,  # only bounds a failure: the case takes about 5 s
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (case,) = out["cases"]
    assert (case["replicas"], case["workers"], case["offered_rps"]) == (1, 2, 100.0)
    assert case["sent"] > 100 and case["answered_per_s"] > 0 and case["refused"] == 0 and case["expired"] == 0
    assert 0 < case["dispatcher_cpu"] <= 1.5 and case["requests_per_core_s"] > 0
    for key in ("decision_p50_ms", "decision_p99_ms", "fill_p50_ms", "fill_p99_ms"):
        assert case[key] is not None and case[key] >= 0, key
    assert out["clock"].startswith("host")
    # neither goal's case ran: neither is called met or missed
    assert out["targets"] == {
        "requests_per_core_s >= 5000": None,
        "decision_p99_ms < 2 at 16 replicas, 904/s": None,
    }


def test_replicas_and_rate_go_together() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dispatcher.py"), "--replicas", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--replicas and --rate go together" in proc.stderr
