"""`bubbletea up` as a user runs it: every service healthy, prompts answered while training runs,
the run folder and report written, a clean stop on Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.e2e.serving import SPEC, status, submit

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


async def _read_until(stream: asyncio.StreamReader, pattern: str, seen: list[str], timeout: float) -> re.Match[str]:
    async with asyncio.timeout(timeout):
        while True:
            raw = await stream.readline()
            if not raw:
                raise AssertionError("bubbletea up exited early:\n" + "".join(seen))
            line = raw.decode()
            seen.append(line)
            if m := re.search(pattern, line):
                return m


async def test_up_serves_prompts_while_training_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    spec = {**SPEC, "http": {"host": "127.0.0.1", "port": 0}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # an embedded Redis of its own
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bubbletea.cli",
        "up",
        "--config",
        str(path),
        "--iterations",
        "400",  # far longer than the test: it ends with Ctrl-C
        "--out",
        str(tmp_path / "runs"),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        api = (await _read_until(proc.stdout, r"API:\s+(http://\S+)", seen, timeout=120)).group(1)
        folder = Path((await _read_until(proc.stdout, r"logs:\s+(\S+)/<service>\.log", seen, timeout=10)).group(1))
        drain = asyncio.create_task(_drain(proc.stdout, seen))
        async with aiohttp.ClientSession() as http:
            ids = [await submit(http, api, {"prompt": f"prompt number {i}"}) for i in range(20)]
            answers = {}
            async with asyncio.timeout(60):
                while len(answers) < len(ids):
                    for rid in ids:
                        if rid not in answers and (a := await status(http, api, rid))["status"] != "queued":
                            answers[rid] = a
                    await asyncio.sleep(0.2)
        assert all(a["status"] == "done" and a["result"]["text"] for a in answers.values()), answers
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(60):
            code = await proc.wait()
        await drain
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out = "".join(seen)
    assert code == 130 or code == 0, out
    assert "==> stopped cleanly" in out, out
    for name in ("wan_broker", "dispatcher", "prefill_queue", "stage_worker-0", "stage_worker-3"):
        assert (folder / f"{name}.log").stat().st_size > 0
    run_folder = folder.parent
    assert (run_folder / "report.md").exists() and (run_folder / "summary.json").exists()
    assert (run_folder / "spec.yaml").exists()


async def _drain(stream: asyncio.StreamReader, seen: list[str]) -> None:
    while raw := await stream.readline():
        seen.append(raw.decode())


def test_up_reports_a_dead_service_by_name(tmp_path: Path) -> None:
    """A spec whose prefill checkpoint does not exist: the workers die at start; up says which."""
    spec = {**SPEC, "http": {"host": "127.0.0.1", "port": 0}}
    spec["prefill"] = {**SPEC["prefill"], "checkpoint": str(tmp_path / "missing.pt")}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    res = subprocess.run(
        [sys.executable, "-m", "bubbletea.cli", "up", "--config", str(path), "--out", str(tmp_path / "runs")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"stage_worker-\d \(pid \d+\) exited with code 1", res.stderr), res.stdout + res.stderr
    assert "missing.pt" in res.stderr
