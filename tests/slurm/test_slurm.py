"""BubbleTea under a real Slurm: deploy/slurm/control.sbatch and workers.sbatch, submitted with
`sbatch` as a user would, to a private cluster (tests/slurm/harness.py): slurmctld and a slurmd
for the control node in this namespace, one slurmd per datacenter in that datacenter's network
namespace, the links between them shaped by the kernel mode's plan (htb), the demo's spec with
`wan.mode: none` (the network between the "hosts" is the WAN).

The tier runs where slurmctld, slurmd and munged are installed and root can make network
namespaces; it is skipped, saying why, elsewhere (or with BUBBLETEA_SLURM_TESTS=off). The tests
share one run and go in file order: training starts (each DC keeping a spare), prefill is
answered, a cancelled worker step is survived, a drained worker hands its slot over with nothing
lost, training ends with the single-process reference's losses, and `scancel` of the jobs leaves
no process and no Redis key of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from bench import chaos
from shared.config.spec import ClusterSpec, load_spec
from shared.dataplane.kernel_net import plan_kernel_net
from shared.wire import IterationDone, WorkerFailed, decode, keys
from tests.slurm.harness import ROOT, TIMINGS, SlurmCluster, free_port, slurm_problem

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

#: Long enough that the kill and then the drain land mid-run and the resumed run still trains for a
#: while (2 to 4 s an iteration here over the demo's shaped links, the slower after a takeover).
ITERATIONS = 36
#: Where the test's namespaces take their addresses (the kernel tests use 10.77 to 10.79, live
#: runs 10.100 to 10.199).
BASE = "10.76"


@dataclass
class Run:
    """The run the tests share: its spec, id, folder, jobs and Redis."""

    spec_path: Path
    spec: ClusterSpec
    run: str
    folder: Path
    env: dict[str, str]
    control_job: str = ""
    worker_jobs: dict[str, str] = field(default_factory=dict)
    submitted: float = 0.0
    control: dict[str, str] = field(default_factory=dict)

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.control["REDIS_URL"], socket_timeout=10)

    def events(self) -> list[object]:
        r = self.redis
        try:
            entries: Any = r.xrange(keys.events_stream(self.run))
            return [decode(f[b"m"]) for _, f in entries]
        finally:
            r.close()

    def logs(self, pattern: str) -> dict[str, str]:
        return {p.name: p.read_text(errors="replace") for p in sorted((self.folder / "logs").glob(pattern))}


def job_ended(cluster: SlurmCluster, job: str) -> bool:
    return cluster.job_state(job) not in {"RUNNING", "PENDING", "COMPLETING"}


def spare_waits(run: Run, dc: str) -> bool:
    return any("waiting as a spare" in t for t in run.logs(f"worker-{dc}-*.log").values())


def wait_for(ok: Callable[[], object], timeout_s: float, what: str, cluster: SlurmCluster) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := ok():
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{cluster.logs_tail()}")


def demo_spec(tmp: Path) -> Path:
    """configs/demo.yaml, over a real network (`wan.mode: none`), checkpointing (spares need it),
    ITERATIONS long, the front door on a free port."""
    spec = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    spec["wan"]["mode"] = "none"
    spec["training"].update(iterations=ITERATIONS, checkpoint_every=2)
    spec["http"]["port"] = free_port()
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def cluster_and_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SlurmCluster, Run]]:
    if (why := slurm_problem()) is not None:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("slurm")
    spec_path = demo_spec(tmp)
    spec = load_spec(spec_path)
    run_id = f"sl{os.getpid()}"
    folder = tmp / "run"
    env = {
        "BUBBLETEA_CONFIG": str(spec_path),
        "BUBBLETEA_RUN": run_id,
        "BT_RUN_DIR": str(folder),
        "BT_REDIS_PORT": str(free_port()),
    }
    (tmp / "slurm").mkdir()
    cluster = SlurmCluster(tmp / "slurm", plan_kernel_net(spec, run_id, base=BASE))
    t0 = time.monotonic()
    cluster.start()
    TIMINGS["slurm_up"] = f"{time.monotonic() - t0:.1f} s"
    run = Run(spec_path, spec, run_id, folder, env)
    try:
        yield cluster, run
    finally:
        for job in [*run.worker_jobs.values(), run.control_job]:
            if job and cluster.job_state(job) in {"RUNNING", "PENDING"}:
                cluster.run("scancel", job, check=False)
        for job in [*run.worker_jobs.values(), run.control_job]:
            if job:
                with contextlib.suppress(AssertionError):
                    wait_for(partial(job_ended, cluster, job), 60, f"job {job} to end", cluster)
        cluster.stop()


def test_jobs_start_and_train_with_a_spare_in_each_datacenter(cluster_and_run: tuple[SlurmCluster, Run]) -> None:
    cluster, run = cluster_and_run
    run.folder.mkdir(parents=True, exist_ok=True)
    run.submitted = time.monotonic()
    out = ["--output", str(run.folder / "%x-%j.out")]
    run.control_job = cluster.sbatch("control.sbatch", "--partition=control", *out, env=run.env)
    for dc in run.spec.datacenters:  # one partition per datacenter: the DC is the partition
        run.worker_jobs[dc.name] = cluster.sbatch("workers.sbatch", f"--partition={dc.name}", *out, env=run.env)
    rendezvous = run.folder / "control.env"
    wait_for(rendezvous.exists, 60, "the control job's rendezvous file", cluster)
    run.control = dict(line.split("=", 1) for line in rendezvous.read_text().splitlines() if "=" in line)
    assert run.control["BUBBLETEA_RUN"] == run.run

    wait_for(lambda: any(isinstance(m, IterationDone) for m in run.events()), 180, "the first iteration", cluster)
    TIMINGS["sbatch_to_training"] = f"{time.monotonic() - run.submitted:.1f} s"
    for dc in run.spec.datacenters:  # each DC's extra step waits as a spare instead of failing
        wait_for(partial(spare_waits, run, dc.name), 60, f"a spare in {dc.name}", cluster)
    steps = cluster.steps(run.worker_jobs[run.spec.datacenters[0].name])
    assert len(steps) == 3, steps  # two slots and the spare, one step each


def completion(run: Run, prompt: str) -> dict[str, object]:
    body = json.dumps({"model": run.spec.prefill.model_name, "prompt": prompt, "max_tokens": 1}).encode()
    req = urllib.request.Request(
        f"{run.control['BT_FRONT_DOOR']}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        answer: dict[str, object] = json.loads(resp.read())
        return answer


def served(run: Run, cluster: SlurmCluster, prompt: str) -> dict[str, object]:
    """The front door's answer to `prompt`, once it serves: it answers 503 while the run is not
    training (before every slot joined, and while a recovery is under way), as a client retries."""

    def attempt() -> dict[str, object] | None:
        try:
            return completion(run, prompt)
        except (urllib.error.URLError, OSError):
            return None

    answer = wait_for(attempt, 90, f"the front door to answer {prompt!r}", cluster)
    assert isinstance(answer, dict)
    return answer


def test_prefill_requests_to_the_front_door_are_answered(cluster_and_run: tuple[SlurmCluster, Run]) -> None:
    cluster, run = cluster_and_run

    assert served(run, cluster, "the bubbles of a pipeline")
    answers = [completion(run, f"prompt number {i} in a bubble") for i in range(8)]
    assert all(a.get("choices") for a in answers), answers


def test_a_cancelled_worker_step_is_survived(cluster_and_run: tuple[SlurmCluster, Run]) -> None:
    cluster, run = cluster_and_run
    dc = run.spec.datacenters[0].name
    job = run.worker_jobs[dc]

    # past the checkpoint of iteration 3: the run resumes from a checkpoint, not from the start
    def reached() -> bool:
        return any(isinstance(m, IterationDone) and m.iteration >= 4 for m in run.events())

    wait_for(reached, 120, "iteration 4", cluster)
    holders = [n for n, t in run.logs(f"worker-{dc}-{job}.*.log").items() if 'msg="slot leased" ' in t]
    step = re.search(r"-(\d+\.\d+)\.log$", holders[0])
    assert step and step.group(1) in cluster.steps(job), (holders, cluster.steps(job))
    t0 = time.monotonic()
    cluster.run("scancel", step.group(1))  # what a dead worker looks like to Slurm: SIGKILL to the step
    # The waiting spare takes the slot, or the step the job starts to replace the dead one does:
    # a new worker leases a slot whose holder may still be expiring (it polls faster than a spare).
    wait_for(
        lambda: any("joined the run" in t for name, t in run.logs(f"worker-{dc}-*.log").items() if name not in holders),
        120, "a spare or a new step to take the slot and join the run", cluster,
    )  # fmt: skip
    TIMINGS["step_cancel_to_spare_training"] = f"{time.monotonic() - t0:.1f} s"
    # serving again once the recovery is over (a 503 meanwhile: retried, as a client does)
    answers = [served(run, cluster, "after the takeover")] + [completion(run, f"after it {i}") for i in range(3)]
    assert all(a.get("choices") for a in answers), answers
    # the job keeps a spare: a new step replaces the lost one
    wait_for(lambda: "starting a new spare" in (run.folder / f"bt-workers-{job}.out").read_text(), 30,
             "a new spare step", cluster)  # fmt: skip


def test_a_drained_worker_hands_its_slot_over_and_nothing_is_lost(cluster_and_run: tuple[SlurmCluster, Run]) -> None:
    """`bubbletea drain SLOT` (as SIGTERM to the worker's step alone asks): the worker finishes its
    iteration and leaves with status 0; the DC's waiting spare takes the slot, the job tells the
    exit from a finished slot's and starts a replacement step, so the DC keeps a spare; requests
    sent meanwhile are answered, or refused at once (503) while the run recovers, never lost.

    What is allowed besides (docs/deploy.md, "Drains and evictions"): a 504 for a request sent
    while the drain was under way (from the command to the spare training). The leaver's queued
    prefill moves to the workers that stay at once, but the run pauses while the spare joins (no
    bubble opens anywhere), this job has no decoder, and a request accepted just before the pause
    waits it out past its 500 ms objective. One sent before the drain or after the spare trains
    must not fail."""
    cluster, run = cluster_and_run
    dc = run.spec.datacenters[-1].name  # not the DC of the cancelled step: its spare has waited all along
    job = run.worker_jobs[dc]
    wait_for(partial(spare_waits, run, dc), 60, f"a spare in {dc}", cluster)
    # Training again after the cancelled step's recovery: a drain asked within 2 s of that recovery
    # (its first iteration not done) stalled the whole run for 88 s here, answering 504 meanwhile.
    iteration = max(m.iteration for m in run.events() if isinstance(m, IterationDone))
    wait_for(lambda: any(isinstance(m, IterationDone) and m.iteration >= iteration + 2 for m in run.events()),
             120, "two more iterations trained", cluster)  # fmt: skip
    assert iteration < ITERATIONS - 10, f"iteration {iteration}: too near the end for a drain to be seen"
    slot = f"r0s{run.spec.parallelism.pp - 1}"  # the demo's last stage is the last DC's
    leased = re.compile(rf'msg="slot leased" .*\bslot={slot}\b')
    holder = [n for n, t in run.logs(f"worker-{dc}-{job}.*.log").items() if leased.search(t)]
    assert len(holder) == 1, (slot, list(run.logs(f"worker-{dc}-{job}.*.log")))
    joined = {n: t.count("joined the run") for n, t in run.logs(f"worker-{dc}-*.log").items()}

    sent: list[tuple[float, int | str]] = []  # (when sent, monotonic; the answer's code)
    stop = threading.Event()

    def load() -> None:  # a client sending on while the drain goes on
        while not stop.is_set():
            at = time.monotonic()
            try:
                got: int | str = 200 if completion(run, f"during the drain {len(sent)}").get("choices") else "empty"
            except urllib.error.HTTPError as exc:
                got = exc.code
            except OSError as exc:
                got = repr(exc)
            sent.append((at, got))
            stop.wait(0.3)

    sender = threading.Thread(target=load)
    sender.start()
    try:
        t0 = time.monotonic()
        drained = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "bubbletea"), "drain", slot, "--timeout", "120"],
            env={**os.environ, **run.env, "REDIS_URL": run.control["REDIS_URL"]},
            capture_output=True, text=True, timeout=180, cwd=ROOT,
        )  # fmt: skip
        assert drained.returncode == 0, drained.stderr
        out = run.folder / f"bt-workers-{job}.out"
        wait_for(lambda: "left the run (drained): starting a replacement" in out.read_text(), 30,
                 "the job to start a replacement for the drained worker", cluster)  # fmt: skip
        # the waiting spare takes the slot (or, should it lose the race, the replacement step does)
        wait_for(
            lambda: any(t.count("joined the run") > joined.get(n, 0)
                        for n, t in run.logs(f"worker-{dc}-*.log").items() if n not in holder),
            120, "a spare or the replacement to take the drained slot and join the run", cluster,
        )  # fmt: skip
        t1 = time.monotonic()
        TIMINGS["drain_to_spare_training"] = f"{t1 - t0:.1f} s"
        assert served(run, cluster, "after the drain").get("choices")
    finally:
        stop.set()
        sender.join(120)
    assert "left the run" in run.logs(holder[0])[holder[0]], holder
    assert "a stage worker finished" not in out.read_text()  # the drain was not counted as a slot done
    codes = [code for _, code in sent]
    assert codes and set(codes) <= {200, 503, 504} and 200 in codes, codes
    outside = [(round(at - t0, 2), code) for at, code in sent if code == 504 and not t0 <= at <= t1]
    assert not outside, f"504s sent outside the drain (0 to {t1 - t0:.2f} s): {outside}"
    TIMINGS["drain_504s"] = f"{codes.count(504)} of {len(codes)}"
    wait_for(lambda: len(cluster.steps(job)) == 3, 60, "two slots and a spare again", cluster)


def test_training_ends_with_the_single_process_losses(cluster_and_run: tuple[SlurmCluster, Run]) -> None:
    cluster, run = cluster_and_run
    for dc, job in run.worker_jobs.items():  # each DC's job ends by itself once its slots finish
        wait_for(partial(job_ended, cluster, job), 300, f"{dc}'s worker job to end", cluster)
        assert cluster.job_state(job) == "COMPLETED", (run.folder / f"bt-workers-{job}.out").read_text()
    events = run.events()
    assert not [m for m in events if isinstance(m, WorkerFailed)]
    done = [m for m in events if isinstance(m, IterationDone)]
    figures = chaos.training_figures(done, run.spec)
    assert figures["iterations_checked"] == ITERATIONS, figures
    # the spare took the cancelled step's slot and its stage's state from the live DP peer: nothing
    # rewound, so nothing trained twice (it was > 0 when a replacement resumed from a checkpoint)
    assert figures["training_resumed"] and figures["iterations_trained_twice"] == 0, figures
    assert figures["losses_equal"], figures
    TIMINGS["sbatch_to_trained"] = f"{time.monotonic() - run.submitted:.1f} s"


def run_processes(run: str) -> list[str]:
    """Processes whose environment names the run (every process the jobs started has it)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if f"BUBBLETEA_RUN={run}".encode() in (p / "environ").read_bytes().split(b"\0"):
                cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{p.name} {cmdline.strip()}")
        except OSError:
            continue
    return found


def test_scancel_leaves_no_process_and_no_redis_key(cluster_and_run: tuple[SlurmCluster, Run]) -> None:
    cluster, run = cluster_and_run
    assert run.redis.keys(keys.run_pattern(run.run)), "the run has keys while its control job runs"
    cluster.run("scancel", run.control_job, *run.worker_jobs.values())
    t0 = time.monotonic()
    wait_for(lambda: not run_processes(run.run), 60, "every process of the run to end", cluster)
    TIMINGS["scancel_to_nothing_left"] = f"{time.monotonic() - t0:.1f} s"
    wait_for(lambda: cluster.job_state(run.control_job) != "RUNNING", 30, "the control job to end", cluster)
    # Redis went with the job; what it would load on a restart (its append-only file) holds nothing
    # of the run: the job removed its files. Start a Redis on that folder to be sure.
    folder = run.folder / "redis"
    folder.mkdir(exist_ok=True)
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--appendonly", "yes",
         "--save", ""], stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        r = redis.Redis(port=port, socket_timeout=5)
        wait_for(lambda: _pings(r), 10, "a Redis on the control job's folder", cluster)
        assert r.keys(keys.run_pattern(run.run)) == []
        r.close()
    finally:
        server.terminate()
        server.wait(10)


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.RedisError:
        return False
