"""A share of the GPU per stage worker, for bench/gpu_check.py (`--gpu-share mps|none`).

Four workers on one GPU without help are time-sliced: the GPU runs one process's kernels at a
time, so one worker's bubble is another's compute and none has the GPU to itself. Under CUDA MPS
(the Multi-Process Service) their kernels run side by side, each worker capped at its share of
the streaming multiprocessors (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`): measured on one H100 on
2026-11-28, the one change that brought BubbleTea's slowdown from 3.1% to 0.46%.

`choose` decides (pure: what was asked, the GPUs, the workers, whether the MPS control binary is
there) and says why; `Mps` starts an MPS control daemon of this check's own, in a pipe directory of
its own (another user's or session's daemon is never touched), sets the environment every process
started afterwards inherits (the workers, and this process's own measurement of prefill's cost),
and stops it. A machine where the daemon cannot start says so, and the check runs time-sliced.
Green contexts partition the SMs among the streams of one process; the workers are processes of
their own, so MPS is the tool here.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
CHOICES = ("mps", "none")


@dataclass(frozen=True)
class Share:
    mode: str  # "mps" or "none" (time-sliced, or a GPU each)
    why: str
    percentage: int | None = None  # each worker's share of the SMs under MPS

    def line(self) -> str:
        cap = f", each worker at {self.percentage}% of the SMs" if self.percentage else ""
        return f"gpu share: {self.mode}{cap} ({self.why})"


def choose(requested: str | None, *, gpus: int, workers: int, mps_binary: bool) -> Share:
    """How `workers` stage workers share `gpus` GPUs. `requested` None: MPS where workers share a
    GPU and MPS is there, else none."""
    if requested == "none":
        return Share("none", "asked for (--gpu-share none): workers sharing a GPU are time-sliced")
    if gpus == 0:
        return Share("none", "no GPU: nothing to share")
    per_gpu = math.ceil(workers / gpus)
    if per_gpu <= 1 and requested is None:
        return Share("none", f"{workers} workers on {gpus} GPUs: one GPU each")
    if not mps_binary:
        return Share("none", f"{CONTROL} is not on the PATH: MPS cannot start; workers are time-sliced")
    return Share("mps", f"{workers} workers on {gpus} GPU(s)", percentage=max(1, 100 // per_gpu))


class Mps:
    """An MPS control daemon of this check's own (`start`, `stop`), its pipe and log under `folder`."""

    def __init__(self, folder: Path) -> None:
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
        self.started = False

    def _control(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        binary = shutil.which(CONTROL) or CONTROL
        env = {**os.environ, **self.env}
        if stdin is None:  # never the caller's terminal
            return subprocess.run(
                [binary, *args], stdin=subprocess.DEVNULL, env=env, capture_output=True, text=True, timeout=30
            )
        return subprocess.run([binary, *args], input=stdin, env=env, capture_output=True, text=True, timeout=30)

    def start(self, share: Share) -> Share:
        """Start the daemon and set this process's environment for its clients; a daemon that
        cannot start leaves the environment as it was and is said in the returned share."""
        if share.mode != "mps":
            return share
        for d in self.env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        try:
            r = self._control("-d")
        except (OSError, subprocess.SubprocessError) as exc:
            return Share("none", f"MPS could not start ({exc}): workers are time-sliced")
        if r.returncode != 0:
            why = (r.stderr or r.stdout).strip() or f"exit code {r.returncode}"
            return Share("none", f"MPS could not start ({why}): workers are time-sliced")
        self.started = True
        os.environ.update(self.env)
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share.percentage)
        return share

    def stop(self) -> None:
        """Quit the daemon (its server goes with it once its clients are gone)."""
        if self.started:
            self._control(stdin="quit\n")
            self.started = False
        for key in (*self.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
            os.environ.pop(key, None)
