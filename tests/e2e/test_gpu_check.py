"""`make gpu-check` (bench/gpu_check.py): BubbleTea on real compute, no device profile, time scale 1.
Wherever a GPU is, it runs there; here, on the CPU, it is a smoke test of the same path: it runs,
says where, and reports every bubble and every request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, "bench/gpu_check.py"]


@pytest.mark.timeout(480)  # a bench run of two trainings, longer than the suite's default
def test_gpu_check_runs_on_real_compute_and_says_where(tmp_path: Path) -> None:
    r = subprocess.run(
        # at most 50 requests/s (--quick's 10 leaves most of the few bubbles counted empty; the bench's
        # default, 200, costs this 2-core suite 9 CPU s more and pins nothing more), over 5 iterations:
        # the load starts once training runs, so the first ones may see none of it. One replica (two
        # workers a run): the device path is the subject; data parallelism is pinned by the training tests
        [*CHECK, "--quick", "--iterations", "5", "--max-rate", "50", "--dp", "1", "--dump", str(tmp_path / "dump")],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    where = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"gpu-check on {where}" in r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["check"] == "gpu" and got["device"] == where and got["mode"] == "real"
    # the job (a GPU's default is the full Llama; here the same path, tiny) and the GPU's share, said
    # in the first line and the JSON (no GPU here: nothing to share)
    job = "full" if torch.cuda.is_available() else "tiny"
    assert got["job"] == job and f"job {job}" in r.stderr
    if not torch.cuda.is_available():
        assert got["gpu_share"] == "none" and "gpu share: none (no GPU" in r.stderr
    # --dump: every run's records, and its bubbles that had work and stayed empty
    dumped = sorted(p.name.split(".", 1)[1] for p in (tmp_path / "dump").iterdir())
    assert dumped.count("empty_bubbles.jsonl") == 2 and dumped.count("spans.jsonl") == 2, dumped
    assert got["time_scale_k"] == 1.0 and got["dp"] == 1  # PP=2 x DP=1 as asked, no profile, k = 1
    # a smoke test on a shared CPU: the requests must flow (nothing lost is pinned by tests/e2e/test_no_loss.py;
    # here a busy machine's client may time out, which the bench counts against it)
    assert got["requests_sent"] > 0 and got["requests_answered"] > 0
    assert 0 < got["offered_load_rps"] <= 50  # --max-rate caps the offered load
    # every bubble of the steady iterations is counted; whether the load reached one of them is the
    # scheduler's (an answered request was computed in some bubble: BubbleTea computes nowhere else,
    # but on a loaded 2-core machine the load may reach only the warm-up's or the last iteration's)
    assert got["bubbles_total"] > 0
    assert got["bubbles_total"] >= got["bubbles_with_work"] >= 0 and got["bubbles_total"] >= got["bubbles_filled"] >= 0
    assert got["losses_equal"] is True  # prefill in the bubbles changed nothing training computed
    assert 0 <= got["slo_attainment"] <= 1 and "valid" in got and "targets" in got
    # the simulator on the device times learned from the pair (bench/lib/sim_fit.py); its error is the
    # GPU's figure to meet (5%), not a CPU's, whose host contention no simulator models
    assert got["sim_fitted"]["fwd_ms_per_layer"] > 0 and got["sim_fitted"]["bwd_ms_per_layer"] > 0
    if "sim_why" not in got:  # prefill fitted: both runs simulated
        off = got["sim_iteration_off_ms"]
        assert off["live"] > 0 and off["sim"] > 0 and got["sim_max_rel_err"] >= 0


def test_gpu_check_refuses_a_dp_it_cannot_run_in_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dp", "3"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 2 and r.stdout == ""  # refused before anything starts
    assert r.stderr.strip().splitlines()[-1].endswith("argument --dp: invalid choice: 3 (choose from 1, 2)")
    assert "Traceback" not in r.stderr
