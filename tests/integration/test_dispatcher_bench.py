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
        "10000 answered/s observed at >= 0.9 core": None,
        "decision_p99_ms < 2 at 16 replicas, 904/s": None,
    }
    assert out["saturated_answered_per_s"] is None and case["injectors"] == 1 and case["accepted_per_s"] > 0


def test_several_injector_processes_offer_the_saturating_load_and_it_is_reported_as_observed() -> None:
    """Issue 62: the headline was the best case's rate per core, extrapolated from a dispatcher that
    ran at half a core (one injector process was the limit); the saturating load now comes from
    several injector processes, and the case says the share of a core it was observed at."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dispatcher.py"), "--replicas", "1", "--rate", "20000",
         "--seconds", "1", "--injectors", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["cases"]
    assert row["injectors"] == 2 and row["sent"] > 0 and row["accepted_per_s"] > 0
    assert isinstance(row["observed_at_0_9_core"], bool)


def test_replicas_and_rate_go_together() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dispatcher.py"), "--replicas", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--replicas and --rate go together" in proc.stderr
