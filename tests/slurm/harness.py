"""A private Slurm cluster for the Slurm tier: munge, slurmctld and one slurmd per node, each node
of a datacenter in that datacenter's network namespace (the kernel mode's plan builds them and
shapes the links between them), the control node in the root namespace.

Everything lives in one temporary folder (slurm.conf, munge's key and socket, the daemons' state,
spool and logs); every daemon is started here, in the foreground, and stopped by its PID. Nothing of
the machine's own Slurm or munge (if any) is read or touched: the daemons and the client commands
get `SLURM_CONF` pointing at our slurm.conf, whose `AuthInfo` names our munge socket.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from bubbletea.launcher.kernel_wan import KernelWanError, check_privileges, kernel_wan
from shared.dataplane.kernel_net import KernelPlan

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "deploy" / "slurm"
#: Measured figures, printed at the end of the session (conftest.py).
TIMINGS: dict[str, str] = {}

#: The commands the tier runs: the daemons, the clients, munge and a Redis for the key check.
COMMANDS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "munged", "redis-server")
#: The control node's name (the datacenters' nodes are named after their datacenters: <dc>-n1).
CONTROL_NODE = "ctl-n1"


def slurm_problem() -> str | None:
    """Why the tier cannot run here, or None."""
    if os.environ.get("BUBBLETEA_SLURM_TESTS", "").lower() in {"off", "0", "no"}:
        return "BUBBLETEA_SLURM_TESTS=off"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not on PATH; Debian: apt-get install slurm-wlm munge)"
    if shutil.which("mungekey") is None and shutil.which("dd") is None:
        return "no mungekey (or dd) to make munge's key"
    try:
        check_privileges()
    except KernelWanError as exc:
        return f"needs root and network namespaces (one per datacenter's node): {exc}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_name(dc: str) -> str:
    return f"{dc}-n1"


class SlurmCluster:
    """munged, slurmctld and the slurmds, up in `start`, down (by PID) in `stop`."""

    def __init__(self, folder: Path, plan: KernelPlan) -> None:
        self.dir = folder
        self.plan = plan
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge" / "munge.socket"
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._wan: AbstractAsyncContextManager[KernelPlan] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # the control node: the root namespace, at the first datacenter's control address (every
        # namespace routes to it: that is how the workers reach Redis and slurmctld)
        self.control_address = plan.dcs[0].control_address

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- up -------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._wan = kernel_wan(self.plan)
        self._loop.run_until_complete(self._wan.__aenter__())
        try:
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._spawn(CONTROL_NODE, ["slurmd", "-D", "-N", CONTROL_NODE, "-f", str(self.conf)])
            for dc in self.plan.dcs:
                name = node_name(dc.name)
                # nsenter, not `ip netns exec` (plan.netns_prefix): that one mounts a /sys of its own,
                # without the cgroup hierarchy slurmd reads at start; only the network is the DC's
                netns = f"--net=/run/netns/{dc.namespace}"
                self._spawn(name, ["nsenter", netns, "slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._wait_nodes_idle(60)
        except BaseException:
            self.stop()
            raise

    def _start_munge(self) -> None:
        (self.dir / "log").mkdir(exist_ok=True)
        d = self.munge_socket.parent
        d.mkdir(mode=0o700, parents=True)
        key = d / "munge.key"
        if shutil.which("mungekey"):
            subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        else:
            dd = ["dd", "if=/dev/urandom", f"of={key}", "bs=1024", "count=1"]
            subprocess.run(dd, check=True, capture_output=True)
        key.chmod(0o600)
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}",
            ],
        )  # fmt: skip
        self._wait(lambda: self.munge_socket.exists(), 20, "munged's socket")

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(exist_ok=True)
        for n in (CONTROL_NODE, *(node_name(d.name) for d in self.plan.dcs)):
            (self.dir / "spool" / n).mkdir(exist_ok=True)
        ctl_port, slurmd_port = free_port(), free_port()
        hostname = socket.gethostname().split(".")[0]
        nodes = [(CONTROL_NODE, self.control_address, "control")]
        nodes += [(node_name(dc.name), dc.ns_address, dc.name) for dc in self.plan.dcs]
        lines = [
            f"ClusterName=bt{self.plan.tag}",
            f"SlurmctldHost={hostname}({self.control_address})",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.dir / 'state'}",
            f"SlurmdSpoolDir={self.dir / 'spool'}/%n",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.dir / 'spool'}/slurmd.%n.pid",
            f"SlurmctldLogFile={self.dir / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.dir / 'log'}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # the nodes share this machine's cores: take the CPUs written here, not the ones found
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "KillWait=15",
            "MinJobAge=30",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
        ]
        lines += [f"NodeName={n} NodeAddr={a} CPUs=6 RealMemory=2000 State=UNKNOWN" for n, a, _ in nodes]
        lines += [f"PartitionName={p} Nodes={n} MaxTime=INFINITE State=UP" for n, _, p in nodes]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.dir / "log" / f"{name}.out", "wb") as log:
            self.daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def _wait(self, ok: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            dead = {n: p.returncode for n, p in self.daemons.items() if p.poll() is not None}
            if dead:
                raise AssertionError(f"waiting for {what}: daemon(s) exited {dead}\n{self.logs_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{self.logs_tail()}")
            time.sleep(0.3)

    def _wait_nodes_idle(self, timeout_s: float) -> None:
        want = {CONTROL_NODE, *(node_name(d.name) for d in self.plan.dcs)}

        def idle() -> bool:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in r.splitlines() if len(line.split()) == 2)
            return all(states.get(n) == "idle" for n in want)

        self._wait(idle, timeout_s, "every node idle in sinfo")

    # --- clients --------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, env: Mapping[str, str] | None = None) -> str:
        r = subprocess.run(argv, capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def sbatch(self, script: str, *options: str, env: Mapping[str, str]) -> str:
        """Submit deploy/slurm/<script> from the checkout (as a user would); returns the job id."""
        r = subprocess.run(
            ["sbatch", "--parsable", *options, str(SCRIPTS / script)],
            capture_output=True, text=True, env={**self.env, **env}, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, f"sbatch {script}: {r.stderr.strip()}"
        return r.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str | None:
        """The job's state (RUNNING, PENDING, COMPLETED ...), None once slurmctld forgot it."""
        out = self.run("scontrol", "show", "job", job, "-o", check=False)
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return None

    def steps(self, job: str) -> list[str]:
        """The job's running steps' ids (<job>.<step>), batch and extern steps aside."""
        out = self.run("squeue", "-h", "-s", "-j", job, "-o", "%i", check=False)
        return [s for s in out.split() if s.split(".")[-1].isdigit()]

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    # --- down -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Every daemon by its PID (slurmds first, munged last), then the namespaces."""
        order = [n for n in self.daemons if n not in {"slurmctld", "munged"}] + ["slurmctld", "munged"]
        for name in order:
            p = self.daemons.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._wan is not None and self._loop is not None:
            self._loop.run_until_complete(self._wan.__aexit__(None, None, None))
            self._loop.close()
            self._wan = self._loop = None
