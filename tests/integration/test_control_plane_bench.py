"""bench/control_plane.py: one tiny case (the 512-GPU mix on 16 emulated workers, one redis-server)
drives a real dispatcher with the simulator's mix and prints one JSON line whose inputs were
really counted: bubble events, requests and reports each as many as were sent, and the CPU of
every process read per input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
BENCH = str(ROOT / "bench" / "control_plane.py")


def test_a_tiny_case_counts_the_mix_it_drives_and_reports_every_figure() -> None:
    proc = subprocess.run(
        [sys.executable, BENCH, "--gpus", "512", "--workers", "16", "--seconds", "2", "--arms", "single"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,  # only bounds a failure: the case takes about 10 s
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["arms"] == ["single"] and out["sizing_inputs_from"].startswith("documented")
    mix = out["mixes"]["512"]
    assert mix["workers"] == 64 and abs(mix["inputs_per_s"] - 2229) < 0.05 * 2229, mix  # the simulator's count
    (case,) = out["cases"]
    assert (case["arm"], case["mix_gpus"], case["workers"]) == ("single", 512, 16)
    offered, measured = case["offered"], case["measured"]
    # a quarter of the 512-GPU job: each kind of input offered, and each counted near what was offered
    assert abs(offered["inputs_per_s"] - mix["inputs_per_s"] / 4) < 1
    for kind in ("requests_per_s", "bubble_events_per_s"):
        assert 0.5 * offered[kind] < measured[kind] < 1.5 * offered[kind], (kind, offered, measured)
    assert measured["reports_per_s"] > 0 and measured["answers_read_per_s"] > 0
    assert 10 < measured["lease_renewals_per_s"] < 24  # 16 workers, one renewal a second each
    # the inputs counted are the kinds counted, over the 2 s window
    assert case["inputs"] == pytest.approx(2 * (measured["inputs_per_s"]), abs=1)
    assert case["sent"] > 0 and case["answered"] <= case["sent"] and case["refused"] == 0
    assert case["dispatcher"]["cpu"] > 0 and case["dispatcher"]["cpu_us_per_input"] > 0
    (node,) = case["redis_nodes"]
    assert node["role"] == "master" and node["cpu_us_per_input"] > 0 and node["used_memory_bytes"] > 0
    assert node["commands_per_input"] >= 1  # every input is at least one command
    assert case["decision_p99_ms"] is not None and case["decision_p99_ms"] >= case["decision_p50_ms"] >= 0
    sizing = out["headline"]["single"]["sizing_8192"]
    assert sizing["dispatchers_at_0_7_core"] >= 1 and sizing["shards_at_0_7_core"] >= 1


def test_a_case_needs_both_its_mix_and_whole_pipelines() -> None:
    proc = subprocess.run(
        [sys.executable, BENCH, "--gpus", "512"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--gpus and --workers go together" in proc.stderr
    proc = subprocess.run(
        [sys.executable, BENCH, "--gpus", "512", "--workers", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "multiple of 16" in proc.stderr


def test_a_dispatcher_per_datacenter_arm_drives_the_mix_through_each_datacenters_dispatcher() -> None:
    """Arm (c): the same tiny case on an embedded cluster with a dispatcher per datacenter (4): each
    worker's bubbles and reports reach its datacenter's dispatcher and the requests the datacenters'
    streams (counted over all four), every dispatcher's CPU is counted, and each answers."""
    proc = subprocess.run(
        [sys.executable, BENCH, "--gpus", "512", "--workers", "16", "--seconds", "2", "--arms", "cluster-per-dc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (case,) = out["cases"]
    assert case["arm"] == "cluster-per-dc" and case["dispatcher"]["processes"] == 4
    offered, measured = case["offered"], case["measured"]
    for kind in ("requests_per_s", "bubble_events_per_s"):
        assert 0.5 * offered[kind] < measured[kind] < 1.5 * offered[kind], (kind, offered, measured)
    assert measured["reports_per_s"] > 0 and measured["answers_read_per_s"] > 0
    d = case["dispatcher"]
    assert d["cpu"] >= d["busiest_cpu"] > 0 and d["cpu_us_per_input"] > 0
    assert len(case["redis_nodes"]) == 6 and case["refused"] == 0
    assert out["per_dc_cost"]["cases"] == []  # arm (b) did not run: nothing to compare with
