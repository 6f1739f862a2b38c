"""bench/lib/cpu_time.py: where a bench's CPU went (the machine's busy share, each process tree's seconds)."""

from __future__ import annotations

import subprocess
import sys

from bench.lib.cpu_time import Sample, sample, used

#: A child that spends 0.4 s of CPU, says so, and waits.
SPIN = (
    "import time\nt = time.process_time()\n"
    "while time.process_time() - t < 0.4: pass\nprint('spun', flush=True)\ninput()"
)


def test_used_is_the_difference_per_label_and_the_machines_busy_share() -> None:
    before = Sample(
        busy_s=10.0, total_s=40.0, trees={1: ("python -m vllm.entrypoints", 5.0), 2: ("bubbletea.cli up", 1.0)}
    )
    after = Sample(
        busy_s=25.0,
        total_s=60.0,
        trees={1: ("python -m vllm.entrypoints", 9.5), 2: ("bubbletea.cli up", 4.0), 3: ("bubbletea.cli up", 0.5)},
    )
    got = used(before, after, {"vllm": "vllm.entrypoints", "bubbletea": "bubbletea.cli", "other": "nothing"})
    # a tree started between the samples counts from zero
    assert got == {"machine_busy_share": 0.75, "vllm_cpu_s": 4.5, "bubbletea_cpu_s": 3.5, "other_cpu_s": 0.0}
    assert used(None, after, {"vllm": "v"}) == {"machine_busy_share": None, "vllm_cpu_s": None}


def test_a_childs_cpu_time_is_counted_in_its_tree() -> None:
    before = sample()
    assert before is not None  # Linux: /proc is there
    child = subprocess.Popen([sys.executable, "-c", SPIN, "spin-marker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"spun\n"
        got = used(before, sample(), {"spin": "spin-marker"})
    finally:
        child.kill()
        child.communicate()  # reaps it and closes its pipes
    assert got["spin_cpu_s"] is not None and 0.35 <= got["spin_cpu_s"] < 5
    assert got["machine_busy_share"] is not None and 0 < got["machine_busy_share"] <= 1
