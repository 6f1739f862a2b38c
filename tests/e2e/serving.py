"""Helpers for the end-to-end tests: a spec with real bubbles, a spec's replicas, a live front door."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from shared.bus.connection import blocking_client
from shared.wire import IterationDone, PrefillReport, WorkerFailed, decode, keys
from shared.wire.status import ItemOutcome

ROOT = Path(__file__).resolve().parents[2]

#: PP=2 x DP=2 with a device profile: each stage's forward counts for 40 ms, so every worker
#: waits tens of milliseconds for its peer in each iteration: bubbles to fill.
SPEC: dict[str, Any] = {
    "name": "serving",
    "datacenters": [{"name": "dc-a", "gpus": 2}, {"name": "dc-b", "gpus": 2}],
    "wan": {"sharing": "temporal", "default": {"latency_ms": 5, "bandwidth_gbps": 1, "connections": 4}},
    "model": {"layers": 2, "d_model": 32, "heads": 4, "seq_len": 16, "vocab": 256, "seed": 3},
    "parallelism": {"pp": 2, "dp": 2, "tp": 1},
    "training": {"schedule": "1f1b", "microbatches": 4, "microbatch_size": 2, "iterations": 8, "seed": 7},
    # compared with references computed here on the CPU: compute there too, even where a GPU exists
    "device": {"kind": "cpu", "fwd_ms_per_layer": 20.0, "allreduce_ms": 5.0, "step_ms": 2.0},
    "bubbletea": {"enabled": True, "max_batch_requests": 8},
    "prefill": {
        "model": {"layers": 4, "d_model": 32, "heads": 4, "seq_len": 128, "vocab": 256, "seed": 11},
        "max_prompt_tokens": 128,
        "request_timeout_s": 60,
        "kv_ttl_s": 120,
    },
}


def replicas(spec: dict[str, Any], dp: int) -> dict[str, Any]:
    """`spec`'s overrides for `dp` data-parallel replicas: `dp` GPUs a datacenter, one worker each.
    A test whose subject is not data parallelism runs one: each stage worker is about 3 CPU s of a
    2-core machine (docs/testing.md, "The suite's time")."""
    return {
        "datacenters": [{**dc, "gpus": dp} for dc in spec["datacenters"]],
        "parallelism": {**spec["parallelism"], "dp": dp},
    }


#: SPEC's overrides for PP=2 x DP=1 (two workers), for the tests whose subject is the serving
#: plane, not data parallelism.
ONE_REPLICA = replicas(SPEC, 1)


def write_spec(tmp_path: Path, **overrides: Any) -> Path:
    spec = {**SPEC, **overrides}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def service_env(redis_url: str, spec_path: Path, run: str) -> dict[str, str]:
    return {
        "REDIS_URL": redis_url,
        "BUBBLETEA_CONFIG": str(spec_path),
        "BUBBLETEA_RUN": run,
        "BUBBLETEA_LOG_LEVEL": "INFO",
    }


async def submit(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with http.post(f"{url}/v1/prefill", json=body) as resp:
        assert resp.status == 202, await resp.text()
        rid: str = (await resp.json())["id"]
        return rid


async def status(http: aiohttp.ClientSession, url: str, rid: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/prefill/{rid}") as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


async def wait_for_message(
    redis_url: str, stream: str, found: Callable[[Any], bool], what: str, timeout: float = 90.0
) -> None:
    """Block on `stream` until a message satisfies `found` (which may also fail on what it sees)."""
    r = blocking_client(redis_url)  # no socket timeout cutting the blocking reads
    cursor, deadline = "0", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            reply: Any = await r.xread({stream: cursor}, block=1000)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    if found(decode(fields[b"m"])):
                        return
        raise AssertionError(f"{what}: not within {timeout:.0f}s")
    finally:
        await r.aclose()


async def wait_for_iteration(redis_url: str, run: str, iteration: int, timeout: float = 90.0) -> None:
    """Block on the run's events until some worker finished `iteration` (training is under way);
    fails at once if a worker reports a failure."""

    def done(msg: Any) -> bool:
        assert not isinstance(msg, WorkerFailed), f"training failed: {msg}"
        return isinstance(msg, IterationDone) and msg.iteration >= iteration

    await wait_for_message(
        redis_url, keys.events_stream(run), done, f"run {run} reaching iteration {iteration}", timeout
    )


async def wait_for_first_bubble(redis_url: str, run: str, timeout: float = 90.0) -> None:
    """Block on the run's bubble stream until a worker announces its first bubble."""
    await wait_for_message(
        redis_url, keys.bubbles_stream(run), lambda _: True, f"run {run} announcing a bubble", timeout
    )


async def final_answers(
    http: aiohttp.ClientSession, url: str, ids: list[str], timeout: float = 120.0
) -> dict[str, dict[str, Any]]:
    """Every request's final status (answered or failed), polled until none is still queued."""
    answers: dict[str, dict[str, Any]] = {}

    async def all_final() -> bool:
        for rid in ids:
            if rid not in answers and (a := await status(http, url, rid))["status"] != "queued":
                answers[rid] = a
        return len(answers) == len(ids)

    await wait_until(all_final, "every request answered or failed", timeout=timeout)
    return answers


async def wait_ready(http: aiohttp.ClientSession, url: str, timeout: float = 30.0) -> None:
    """Poll the front door's /ready until 200: training runs and a dispatcher fills its bubbles."""

    async def ready() -> bool:
        async with http.get(f"{url}/ready") as resp:
            return resp.status == 200

    await wait_until(ready, f"{url}/ready answering 200", timeout)


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    """Poll a condition on stored state (Redis has no event for it) until it holds, or fail naming it."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.02)


async def wait_for_an_answer(redis_url: str, run: str, timeout: float = 60.0) -> None:
    """Block on the run's prefill reports until a worker reports a request answered."""

    def answered(msg: Any) -> bool:
        return isinstance(msg, PrefillReport) and any(p.outcome is ItemOutcome.DONE for p in msg.progress)

    await wait_for_message(redis_url, keys.prefill_reports_stream(run), answered, f"run {run} answering", timeout)


def as_from_a_terminal() -> None:
    """`preexec_fn` for a child a test stops with SIGINT, as Ctrl-C would: SIGINT's default action
    restored. A suite started in the background by a script (`make test &`) inherits SIGINT
    ignored, and a child that ignores it would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def start_up(*args: str, env: dict[str, str], **options: Any) -> asyncio.subprocess.Process:
    """`bubbletea up` with `args`, in its own process group (the test kills it whole if it fails),
    its output (stdout and stderr) a pipe to read with `read_until`."""
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bubbletea.cli", "up", *args),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        **options,
    )
    assert proc.stdout is not None
    return proc


async def read_until(stream: asyncio.StreamReader, pattern: str, seen: list[str], timeout: float) -> re.Match[str]:
    """Read `bubbletea up`'s output (kept in `seen`) until a line matches `pattern`."""
    async with asyncio.timeout(timeout):
        while True:
            raw = await stream.readline()
            if not raw:
                raise AssertionError("bubbletea up exited early:\n" + "".join(seen))
            line = raw.decode()
            seen.append(line)
            if m := re.search(pattern, line):
                return m
