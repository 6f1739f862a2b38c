"""The Slurm batch scripts of `deploy/slurm/` without a Slurm: they parse (`bash -n`), pass shellcheck
(skipped, saying why, where it is not installed), and the loop both source (supervise.sh) does what
they rely on, driven through stand-ins for `srun` (runs the command) and `scancel` (signals what the
stand-in srun started). tests/slurm runs the scripts themselves on a real Slurm.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
SCRIPTS = sorted([*SLURM.glob("*.sbatch"), SLURM / "supervise.sh"])

#: srun's options dropped, the command run as its task, SIGTERM passed on to it as srun does (its pid
#: kept for the stand-in scancel once it passes signals on). Not `exec`: a SIGTERM landing between
#: the pid's write and the exec was lost by bash, the task running on (a CI run, 2026-11-28).
FAKE_SRUN = """#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done
"$@" &
task=$!
trap 'kill -TERM "$task" 2>/dev/null' TERM
echo $$ >> "$STEPS_FILE"
wait "$task"; code=$?
while kill -0 "$task" 2>/dev/null; do wait "$task"; code=$?; done
exit "$code"
"""
#: scancel --signal=TERM JOB: SIGTERM to every task the stand-in srun started, as Slurm does.
FAKE_SCANCEL = """#!/bin/bash
while read -r pid; do kill -TERM "$pid" 2>/dev/null; done < "$STEPS_FILE"
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_the_scripts_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    r = subprocess.run(
        ["shellcheck", "--external-sources", *(str(s.relative_to(ROOT)) for s in SCRIPTS)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout


@pytest.fixture
def fake_slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STEPS_FILE": str(tmp_path / "steps"),
        "SLURM_JOB_ID": "1",
        "BT_MAX_RESTARTS": "2",
    }


def supervised(body: str) -> str:
    """A batch script's shape: `say`, the loop sourced, then `body`."""
    return f'set -uo pipefail\nsay() {{ echo "say: $*"; }}\n. {SLURM / "supervise.sh"}\n{body}'


def test_a_failing_step_is_restarted_within_its_budget_and_the_rest_stopped_at_the_end(
    fake_slurm: dict[str, str],
) -> None:
    body = """
on_exit() {
    echo "ended $1 $2"
    if restart_allowed "$1"; then step_start "$1" sh -c 'exit 3'; fi
}
on_stopped() { echo "every step ended"; }
each_round() { [ "$(steps_running)" -gt 1 ] || steps_exit 0; }
step_start flaky --job-name=x sh -c 'exit 3'
step_start steady sleep 60
steps_follow on_exit each_round
"""
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", supervised(body)], env=fake_slurm, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines.count("ended flaky 3") == 3, lines  # the first run and BT_MAX_RESTARTS=2 restarts
    assert "ended steady" not in r.stdout  # stopped by steps_exit, not reaped by the loop
    assert lines[-3:] == ["say: stopping", "every step ended", "say: stopped"], lines
    assert time.monotonic() - t0 < 30  # `sleep 60` was stopped by the SIGTERM, and waited for


def test_sigterm_to_the_script_stops_every_step_and_waits_for_them(fake_slurm: dict[str, str], tmp_path: Path) -> None:
    body = """
on_exit() { echo "ended $1 $2"; }
step_start a sleep 60
step_start b sleep 60
steps_follow on_exit
"""
    script = subprocess.Popen(
        ["bash", "-c", supervised(body)], env=fake_slurm, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    steps = tmp_path / "steps"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(steps.read_text().split() if steps.exists() else []) < 2:
        time.sleep(0.1)
    pids = [int(p) for p in steps.read_text().split()]
    script.send_signal(signal.SIGTERM)
    out, err = script.communicate(timeout=30)
    assert script.returncode == 0, err
    assert out.splitlines()[-2:] == ["say: stopping", "say: stopped"], out
    for pid in pids:  # each step ended before the script did
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
