"""Drive `docker compose` for the compose tier: a project of its own (name, ports, password, API
key), commands with their output kept for the failure message, and the engine check that decides
whether the tier runs at all."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: Measured figures, printed at the end of the session (conftest.py).
TIMINGS: dict[str, str] = {}
#: Where a failed build points the reader (Docker Hub or the PyTorch index out of reach).
BUILD_ADVICE = (
    "if Docker Hub or the PyTorch index is out of reach, build the base images first: "
    "`sudo docker/base-images.sh >> .env` (docs/compose.md, 'Where Docker Hub is out of reach')"
)


def engine_problem() -> str | None:
    """Why the tier cannot run here, or None: it runs whenever a Docker engine answers."""
    if os.environ.get("BUBBLETEA_COMPOSE_TESTS", "").lower() in {"off", "0", "no"}:
        return "BUBBLETEA_COMPOSE_TESTS=off"
    if shutil.which("docker") is None:
        return "no `docker` command on PATH"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 20 s"
    if info.returncode != 0:
        why = (info.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return f"no Docker engine answers (docker info: {why})"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode != 0:
        return "`docker compose` (Compose v2) is not installed"
    return None


#: The images compose builds from or pulls, with compose.yaml's defaults.
IMAGE_SETTINGS = {"BASE": "python:3.11-slim", "REDIS_IMAGE": "redis:7-alpine"}


def dotenv(path: Path = ROOT / ".env") -> dict[str, str]:
    """The KEY=VALUE lines of compose's .env (comments and blank lines skipped)."""
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {k.strip(): v.strip().strip("'\"") for k, v in pairs}


def images_problem() -> str | None:
    """Why the images compose needs cannot be had here, or None: each is present, or pulls."""
    settings = {**IMAGE_SETTINGS, **{k: v for k, v in dotenv().items() if k in IMAGE_SETTINGS}}
    settings.update({k: os.environ[k] for k in IMAGE_SETTINGS if os.environ.get(k)})
    for key, image in settings.items():
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=30).returncode == 0:
            continue
        try:
            pulled = subprocess.run(["docker", "pull", image], capture_output=True, timeout=120).returncode == 0
        except subprocess.TimeoutExpired:
            pulled = False
        if not pulled:
            return f"{key} image {image} is not here and cannot be pulled: {BUILD_ADVICE}"
    return None


def time_scale() -> str:
    """The device time scale the project runs at: `BUBBLETEA_TIME_SCALE` where set, else measured
    here as `bubbletea up` measures it (`calibrate`, on compose's spec): compose's own default, 1, is
    more than a slow 2-core machine keeps (on 2026-12-02 the burst, the crash and the drain tests
    saw 429s at k = 1, and none at k = 15, the k `up` measured that day)."""
    if os.environ.get("BUBBLETEA_TIME_SCALE"):
        return os.environ["BUBBLETEA_TIME_SCALE"]
    from shared.config.settings import load_settings
    from shared.model.calibration import calibrate

    return f"{calibrate(load_settings(ROOT / 'configs' / 'demo.yaml', env={}).spec).scale:g}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Project:
    """One compose project under test: its own name, loopback ports, Redis password and API key."""

    def __init__(self) -> None:
        self.name = f"bubbletea-test-{os.getpid()}"
        self.port, self.prometheus_port = free_port(), free_port()
        self.api_key = secrets.token_hex(16)
        self.env = os.environ | {
            "REDIS_PASSWORD": secrets.token_hex(24),
            "BUBBLETEA_API_KEY": self.api_key,
            "BUBBLETEA_PORT": f"127.0.0.1:{self.port}",
            "PROMETHEUS_PORT": f"127.0.0.1:{self.prometheus_port}",
            "BUBBLETEA_TIME_SCALE": time_scale(),
        }
        TIMINGS["time_scale"] = self.env["BUBBLETEA_TIME_SCALE"]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`docker compose -p NAME ARGS` in the checkout (so its .env applies); a failure shows the
        command and the tail of its output."""
        cmd = ["docker", "compose", "-p", self.name, *args]
        done = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
            raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{tail}")
        return done

    def down(self, check: bool = True) -> None:
        """`down -v` with every profile, so nothing the tests started is left behind."""
        profiles = ["--profile", "monitoring", "--profile", "loadgen"]
        self.compose(*profiles, "down", "--volumes", "--remove-orphans", check=check)

    def containers(self, service: str) -> list[str]:
        """The names of `service`'s containers, running or not, by replica number."""
        out = self.compose("ps", "--all", "--format", "{{.Name}}", service).stdout.split()
        return sorted(out, key=lambda n: int(n.rsplit("-", 1)[1]))

    def inspect(self, container: str, template: str) -> str:
        return docker("inspect", "--format", template, container).strip()

    def logs(self, container: str, since: float | None = None) -> str:
        args = ["logs", container] if since is None else ["logs", "--since", f"{since:.3f}", container]
        done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    def ready(self) -> dict[str, Any] | None:
        """/ready's body when it answers 200, else None."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/ready", timeout=2) as resp:
                return dict(json.load(resp))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_ready(self, timeout_s: float, state: str = "serving") -> float:
        """Seconds until /ready answers 200 with `state`; fails after `timeout_s`."""
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout_s:
            last = self.ready()
            if last is not None and last.get("state") == state:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"/ready was not {state!r} within {timeout_s:.0f} s (last answer: {last})")

    def resources(self, kind: str) -> list[str]:
        """What the engine still holds of this project: containers, networks or volumes."""
        label = f"label=com.docker.compose.project={self.name}"
        if kind == "containers":
            return docker("ps", "--all", "--quiet", "--filter", label).split()
        return docker(kind[:-1], "ls", "--quiet", "--filter", label).split()


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout
