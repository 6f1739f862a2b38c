"""A running `bubbletea up` for the browser tier, as tests/e2e/test_launcher_up.py starts it (its
spec and given time scale, an embedded Redis of its own, its own process group), from synchronous
code: Selenium's client is synchronous, so the tier's tests are too. Also a steady trickle of
prompts to its front door, and its /metrics read as it prints them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.test_launcher_up import GIVEN_SCALE, TWO_WORKERS

ROOT = Path(__file__).resolve().parents[2]
#: `up` prints this once every service is healthy; its start is imports and forks, about 30 s on 2 cores.
STARTED = r"Ctrl-C stops everything"
START_TIMEOUT_S = 120


class Output:
    """A process's output lines, read by a thread as they come, waited on by pattern."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for raw in stream:
            with self._changed:
                self.lines.append(raw.decode(errors="replace"))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first line matching `pattern`; AssertionError with the output if none comes in time."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    why = "exited" if self._ended else f"printed no {pattern!r} within {timeout:.0f} s"
                    raise AssertionError(f"bubbletea up {why}:\n" + "".join(self.lines[-80:]))
                self._changed.wait(left)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)


@dataclass
class Up:
    """What a test needs of a running `up`: where it answers and what it printed."""

    api: str
    redis_url: str
    output: Output
    #: time.monotonic() when /ready first said serving
    ready_at: float = field(default=0.0)


def get_json(url: str, timeout: float = 10) -> tuple[int, Any]:
    """(status, body) of a GET whose body is JSON, whatever its status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"null")


def wait_serving(api: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            code, body = get_json(f"{api}/ready", timeout=5)
        except (urllib.error.URLError, OSError):
            code, body = 0, None
        if code == 200 and body["state"] == "serving":
            return
        assert time.monotonic() < deadline, f"{api}/ready: not serving within {timeout:.0f} s: {code} {body}"
        time.sleep(0.2)  # /ready is polled: a client has nothing to wait on


def metrics(api: str) -> dict[str, float]:
    """The front door's /metrics: each sample's value by its name and labels exactly as printed."""
    with urllib.request.urlopen(f"{api}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)  # prometheus_client prints no timestamps
            out[sample] = float(value)
    return out


@contextmanager
def start_up(folder: Path) -> Iterator[Up]:
    """`bubbletea up` on PP=2 x DP=1, no API key, the front door on a free port, until /ready says
    serving; on exit SIGTERM (a clean stop), and SIGKILL of its whole group if that does not end it."""
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({**TWO_WORKERS, "http": {"host": "127.0.0.1", "port": 0}}))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BUBBLETEA_API_KEY")} | GIVEN_SCALE
    argv = [sys.executable, "-m", "bubbletea.cli", "up", "--config", str(spec), "--out", str(folder / "runs")]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    assert proc.stdout is not None
    output = Output(proc.stdout)
    try:
        output.wait_for(STARTED, START_TIMEOUT_S)
        text = output.text()
        running = Up(
            api=re.findall(r"API:\s+(http://\S+)", text)[0],
            redis_url=re.findall(r"==> Redis: (redis://\S+)", text)[0],
            output=output,
        )
        wait_serving(running.api, timeout=60)
        running.ready_at = time.monotonic()
        yield running
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its group: a fork server left holding its stdout, too
            proc.wait()
        output.join(timeout=10)
        proc.stdout.close()


class Load:
    """Prompts posted to the front door's native API, `rate` a second, from a thread, until closed.
    Each is accepted (202) or refused (a worker just lost: 503); both are counted, neither fails."""

    def __init__(self, api: str, rate: float = 4.0) -> None:
        self.api, self.period = api, 1.0 / rate
        self.accepted = self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _send(self) -> None:
        i = 0
        # a generous objective: the subject is the page, not the 500 ms default on a loaded host
        while not self._stop.wait(self.period):
            body = json.dumps({"prompt": f"a prompt for the page, number {i}", "ttft_objective_ms": 10_000})
            req = urllib.request.Request(
                f"{self.api}/v1/prefill", data=body.encode(), headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    self.accepted += resp.status == 202
            except urllib.error.HTTPError as e:
                e.close()
                self.refused += 1
            except (urllib.error.URLError, OSError):
                self.refused += 1  # the front door restarting: the next prompt tries again
            i += 1
