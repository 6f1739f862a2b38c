"""The Slurm batch scripts of `deploy/slurm/` without a Slurm: they parse (`bash -n`), pass shellcheck
(skipped, saying why, where it is not installed), and the loop both source (supervise.sh) does what
they rely on, driven through stand-ins for `srun` (runs the command) and `scancel` (signals what the
stand-in srun started). The scripts themselves run on the same stand-ins with a recording interpreter
for the services: the control job starts one dispatcher, or with `bubbletea.dispatch: per_dc` one per
datacenter the project's own `dispatch_dcs` gives, each naming its DC, and the worker jobs take the
mode from its rendezvous file. tests/slurm runs the scripts on a real Slurm.
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


# --- the batch scripts themselves, on the stand-ins: which services they start, and how ---------

#: The interpreter the scripts run services with (BT_PYTHON): a service is recorded (its module, the
#: datacenter and dispatch mode it sees) and waits to be stopped; anything else (the scripts read the
#: bubbletea command's JSON with it) runs on the real one.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = -m ] && [ "${2#services.}" != "$2" ]; then
    echo "$2 dc=${BUBBLETEA_DC:-} dispatch=${BUBBLETEA_DISPATCH:-}" >> "$SERVICES_FILE"
    sleep 60 >/dev/null 2>&1 &
    trap 'kill "$!"; exit 0' TERM
    wait
    exit 0
fi
exec %s "$@"
"""


@pytest.fixture
def fake_services(fake_slurm: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The stand-in Slurm, the recording interpreter, and a run folder; Redis is never reached."""
    import sys

    python = tmp_path / "bin" / "python"
    python.write_text(FAKE_PYTHON % sys.executable)
    python.chmod(0o755)
    return {
        **fake_slurm,
        "BUBBLETEA_HOME": str(ROOT),
        "BT_PYTHON": str(python),
        "SERVICES_FILE": str(tmp_path / "services"),
        "BT_RUN_DIR": str(tmp_path / "run"),
        "BUBBLETEA_RUN": "t",
        "BUBBLETEA_CONFIG": "configs/demo.yaml",
    }


def _started(env: dict[str, str], script: str, ready: Path, steps: int) -> tuple[list[str], str]:
    """Run `script` until `ready` exists and `steps` services started, then SIGTERM it: the services'
    lines (sorted), and `ready`'s text."""
    services = Path(env["SERVICES_FILE"])
    proc = subprocess.Popen(
        ["bash", str(SLURM / script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            lines = services.read_text().splitlines() if services.exists() else []
            if ready.exists() and len(lines) >= steps:
                break
            time.sleep(0.1)  # the script's own polling loop: no event to wait on from outside
        text = ready.read_text() if ready.exists() else ""
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert text, f"{script} never got ready:\n{out}\n{err}"
    return sorted(services.read_text().splitlines()), text


def _control_env(fake_services: dict[str, str], **env: str) -> dict[str, str]:
    # a Redis of BT_REDIS_URL (no Redis step; never reached: the services are stand-ins)
    return {**fake_services, "BT_REDIS_URL": "redis://:pw@127.0.0.1:1/0", "BT_CONTROL_HOST": "127.0.0.1", **env}


def _per_dc_dcs() -> list[str | None]:
    from shared.config.settings import load_settings
    from shared.policies.pipeline_plan import dispatch_dcs

    return dispatch_dcs(load_settings(ROOT / "configs" / "demo.yaml", env={"BUBBLETEA_DISPATCH": "per_dc"}).spec)


def test_the_control_job_runs_one_dispatcher_by_default(fake_services: dict[str, str]) -> None:
    env = _control_env(fake_services)
    lines, rendezvous = _started(env, "control.sbatch", Path(env["BT_RUN_DIR"]) / "control.env", 3)
    assert lines == sorted(
        f"services.{s} dc= dispatch=one" for s in ("wan_broker", "dispatcher", "prefill_queue")
    )  # fmt: skip
    assert "BUBBLETEA_DISPATCH=one" in rendezvous.splitlines()  # what the worker jobs take


def _per_dc_spec(tmp_path: Path) -> Path:
    """configs/demo.yaml with `bubbletea.dispatch: per_dc` in the spec itself."""
    import yaml

    spec = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    spec.setdefault("bubbletea", {})["dispatch"] = "per_dc"
    path = tmp_path / "per-dc.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("where", ["environment", "spec"])
def test_the_control_job_runs_a_dispatcher_per_datacenter(
    where: str, fake_services: dict[str, str], tmp_path: Path
) -> None:
    """per_dc, from BUBBLETEA_DISPATCH at submit or from the spec: a dispatcher step for each
    datacenter the project's own dispatch_dcs gives, each with BUBBLETEA_DC naming it, every step
    in the per_dc mode, and the mode in the rendezvous file the worker jobs read."""
    extra = (
        {"BUBBLETEA_DISPATCH": "per_dc"}
        if where == "environment"
        else {"BUBBLETEA_CONFIG": str(_per_dc_spec(tmp_path))}
    )
    env = _control_env(fake_services, **extra)
    dcs = _per_dc_dcs()
    assert len(dcs) > 1 and None not in dcs
    lines, rendezvous = _started(env, "control.sbatch", Path(env["BT_RUN_DIR"]) / "control.env", 2 + len(dcs))
    assert lines == sorted(
        [
            "services.wan_broker dc= dispatch=per_dc",
            "services.prefill_queue dc= dispatch=per_dc",
            *(f"services.dispatcher dc={dc} dispatch=per_dc" for dc in dcs),
        ]
    )
    assert "BUBBLETEA_DISPATCH=per_dc" in rendezvous.splitlines()


def test_a_worker_job_takes_the_dispatch_mode_from_the_control_job(fake_services: dict[str, str]) -> None:
    """Whatever its own environment says, a datacenter's workers run in the mode of the control job's
    rendezvous file: every service of the run agrees."""
    run_dir = Path(fake_services["BT_RUN_DIR"])
    run_dir.mkdir()
    (run_dir / "control.env").write_text(
        "REDIS_URL=redis://:pw@127.0.0.1:1/0\nBUBBLETEA_RUN=t\nBUBBLETEA_CONFIG=configs/demo.yaml\n"
        "BUBBLETEA_WAN=none\nBUBBLETEA_DISPATCH=per_dc\n"
    )
    env = {
        **fake_services,
        "BUBBLETEA_DC": "dc-a",
        "BUBBLETEA_DISPATCH": "one",
        "BUBBLETEA_PLANE_HOST": "127.0.0.1",
        "SLURM_NTASKS": "3",
    }
    lines, _ = _started(env, "workers.sbatch", run_dir / "control.env", 3)  # 2 slots of dc-a + 1 spare
    assert lines == ["services.stage_worker dc=dc-a dispatch=per_dc"] * 3
