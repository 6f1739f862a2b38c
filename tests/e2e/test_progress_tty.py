"""`bubbletea train` on a terminal draws a bar with the iterations done, their total and the time left
(`bubbletea.progress`); piped, it prints today's lines only (the other e2e tests read those)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

from tests.unit.test_progress import run_on_a_pty

#: The smallest pipeline: two stages of a tiny model in two datacenters, three iterations.
SPEC = {
    "name": "progress",
    "datacenters": [{"name": "dc-a", "gpus": 1}, {"name": "dc-b", "gpus": 1}],
    "wan": {"sharing": "temporal", "default": {"latency_ms": 5, "bandwidth_gbps": 1, "connections": 2}},
    "model": {"layers": 2, "d_model": 32, "heads": 4, "seq_len": 16, "vocab": 256, "seed": 3},
    "parallelism": {"pp": 2, "dp": 1, "tp": 1},
    "device": {"kind": "cpu"},
    "training": {"schedule": "1f1b", "microbatches": 2, "microbatch_size": 2, "iterations": 3, "seed": 7},
}


def test_train_on_a_terminal_draws_a_bar_of_the_iterations(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BUBBLETEA_PROGRESS")}  # embedded Redis
    env["TERM"] = "xterm"
    argv = [sys.executable, "-m", "bubbletea.cli", "train", "--config", str(spec), "--out", str(tmp_path / "runs")]
    code, text = run_on_a_pty(argv, env, timeout=240)
    assert code == 0, text
    assert "Traceback" not in text
    assert re.search(r"training: +\d+%\|.*\| 2/3 \[\d\d:\d\d<\d\d:\d\d", text), text  # done/total, elapsed<left
    assert len(re.findall(r"iteration +\d+  loss", text)) == 3  # the lines, above the bar
    assert "==> done: steady iteration time" in text
