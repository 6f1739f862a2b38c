"""The GPU check's share of the GPU per worker (bench/lib/gpu_share.py): when it asks for MPS, each
worker's cap, and that a machine where MPS cannot start says so and runs time-sliced."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def gpu_share() -> Any:
    from bench.lib import gpu_share as module

    return module


def test_workers_sharing_a_gpu_get_mps_each_capped_at_its_share(gpu_share: Any) -> None:
    s = gpu_share.choose(None, gpus=1, workers=4, mps_binary=True)
    assert (s.mode, s.percentage) == ("mps", 25) and "each worker at 25% of the SMs" in s.line()
    assert gpu_share.choose(None, gpus=2, workers=4, mps_binary=True).percentage == 50
    assert gpu_share.choose("mps", gpus=1, workers=2, mps_binary=True).percentage == 50
    # a GPU each: nothing to share unless asked
    assert gpu_share.choose(None, gpus=4, workers=4, mps_binary=True).mode == "none"
    assert gpu_share.choose("mps", gpus=4, workers=4, mps_binary=True).percentage == 100


def test_without_a_gpu_or_mps_or_when_told_not_to_it_runs_time_sliced_saying_why(gpu_share: Any) -> None:
    assert "no GPU" in gpu_share.choose("mps", gpus=0, workers=4, mps_binary=True).why
    off = gpu_share.choose("mps", gpus=1, workers=4, mps_binary=False)
    assert off.mode == "none" and "nvidia-cuda-mps-control is not on the PATH" in off.why
    assert "asked for" in gpu_share.choose("none", gpus=1, workers=4, mps_binary=True).why


def test_a_daemon_that_cannot_start_leaves_the_environment_alone_and_says_why(
    gpu_share: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a control binary that refuses, as one does on a machine whose driver has no MPS
    binary = tmp_path / "bin" / gpu_share.CONTROL
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\necho 'An instance of this daemon is already running' >&2\nexit 1\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}:{os.environ['PATH']}")
    mps = gpu_share.Mps(tmp_path / "mps")
    got = mps.start(gpu_share.Share("mps", "4 workers on 1 GPU(s)", percentage=25))
    assert got.mode == "none" and "already running" in got.why and "time-sliced" in got.why
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    mps.stop()  # nothing started: nothing to quit


def test_a_started_daemon_sets_its_own_pipe_and_the_cap_for_every_process_started_after(
    gpu_share: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stand-in for the control binary where no GPU is: it records how it was called
    calls = tmp_path / "calls"
    binary = tmp_path / "bin" / gpu_share.CONTROL
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\necho "$* pipe=$CUDA_MPS_PIPE_DIRECTORY $(cat)" >> {calls}\n')
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}:{os.environ['PATH']}")
    mps = gpu_share.Mps(tmp_path / "mps")
    assert mps.start(gpu_share.Share("mps", "4 workers on 1 GPU(s)", percentage=25)).mode == "mps"
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")  # its own, not the system's
    mps.stop()
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    started, quit_ = calls.read_text().splitlines()
    assert started.startswith(f"-d pipe={tmp_path / 'mps' / 'pipe'}") and quit_.endswith("quit")
