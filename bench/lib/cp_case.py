"""One case of bench/control_plane.py: a backend (one redis-server, or a Redis Cluster), a real
dispatcher process on it (or one per datacenter: arm `cluster-per-dc`), emulated workers
(`bench/lib/cp_workers.py`, in processes of their own) and a front door (`bench/lib/cp_front.py`)
producing a `Mix` scaled to `workers`, and what each process spent in the measured window.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from redis.asyncio import Redis

from bench.lib.cp_figures import figures
from bench.lib.cp_mix import PP, Mix
from bench.lib.cp_workers import HOLDER
from bench.lib.procfs import cpu_seconds
from bubbletea.launcher.procs import spawn, stop_all
from bubbletea.launcher.services import DISPATCHER, instances
from shared.bus.connection import client_for
from shared.config.spec import parse_spec
from shared.control.health import HEARTBEAT_INTERVAL_S
from shared.policies.pipeline_plan import dispatch_dcs, placement_of
from shared.wire import keys

LIB = Path(__file__).resolve().parent
#: Children's start (imports) before the warm-up counts, and the warm-up (the dispatcher learns the
#: bubbles and costs) before the measured window opens.
STARTUP_S = 2.5
WARMUP_S = 2.0
#: How long the slots' leases are first set for: the whole start-up, however many dispatchers start
#: first (the workers then renew each to its 3 s, `keys.LEASE_TTL_MS`).
STARTUP_LEASE_S = 60.0
#: A request's cost on its emulated device (0.2 ms a 96-token prompt, as bench/dispatcher.py):
#: the control plane, not the compute, is measured.
REQUEST_S = 0.0002
#: Emulated workers per process at most (one Python event loop drives about this many here).
WORKERS_PER_PROC = 96


@dataclass
class Node:
    """One server process of a backend."""

    role: str  # "master" or "replica"
    pid: int
    port: int


@dataclass
class Backend:
    url: str
    nodes: list[Node]
    stop: Callable[[], None]


def spec(dp: int, dispatch: str = "one") -> dict[str, Any]:
    """PP=16 over 4 datacenters (4 stages each), as the simulator's scale case; `dispatch`:
    `bubbletea.dispatch` (one, or per_dc: a dispatcher per datacenter)."""
    return {
        "name": "control-plane-bench",
        "datacenters": [{"name": f"dc-{i}", "gpus": dp * PP // 4} for i in range(4)],
        "model": {"layers": 32},
        "parallelism": {"pp": PP, "dp": dp},
        "bubbletea": {"enabled": True, "max_batch_requests": 32, "dispatch": dispatch},
        "prefill": {"max_prompt_tokens": 256, "request_timeout_s": 30.0, "max_queue_depth": 10_000_000},
    }


async def _child(script: str, cfg: dict[str, Any]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, str(LIB / script), json.dumps(cfg), stdout=asyncio.subprocess.PIPE
    )


async def _node_info(nodes: list[Node], section: str, field: str) -> list[int | None]:
    out: list[int | None] = []
    for n in nodes:
        r = Redis(host="127.0.0.1", port=n.port, protocol=2)
        try:
            info: Any = await r.info(section)
            out.append(int(info[field]))
        except Exception:  # a node that does not answer is reported as None
            out.append(None)
        finally:
            await r.aclose()
    return out


async def _accepted(url: str, run: str, dcs: list[str | None]) -> int | None:
    """Requests accepted into the run's request streams so far (XINFO entries-added; None before
    Redis 7): one, or one per datacenter (`dcs`)."""
    r = client_for(url)
    try:
        total = 0
        for dc in dcs:
            info: Any = await r.xinfo_stream(keys.prefill_requests_stream(run, dc))
            n = info.get("entries-added")
            if n is None:
                return None
            total += int(n)
        return total
    finally:
        await r.aclose()


async def _heartbeats(url: str, pids: list[int], after: float) -> dict[str, Any]:
    """The dispatchers' first heartbeats at or after `after`, as one: the largest decision
    percentiles, the refusals and expiries summed."""
    beats = [await _heartbeat(url, pid, after) for pid in pids]
    if len(beats) == 1:
        return beats[0]
    out: dict[str, Any] = {}
    for k in ("decision_ms_p50", "decision_ms_p99"):
        got = [b[k] for b in beats if b.get(k) is not None]
        out[k] = max(got) if got else None
    for k in ("overloaded", "expired"):
        out[k] = sum(int(b.get(k) or 0) for b in beats)
    return out


async def _heartbeat(url: str, pid: int, after: float) -> dict[str, Any]:
    """The dispatcher's first heartbeat at or after `after` (wall clock), read by its own key."""
    r = client_for(url)
    key = keys.health_key("dispatcher", f"{socket.gethostname()}-{pid}")
    give_up = time.monotonic() + 3 * HEARTBEAT_INTERVAL_S
    try:
        while True:
            raw: Any = await r.get(key)
            beat = json.loads(raw) if raw else {}
            if beat.get("ts", 0.0) >= after or time.monotonic() > give_up:
                return beat
            await asyncio.sleep(0.1)
    finally:
        await r.aclose()


def _cpu(pids: list[int]) -> list[float]:
    return [cpu_seconds(p) or 0.0 for p in pids]


async def _until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.time()))


async def run_case(backend: Backend, arm: str, mix: Mix, seconds: float, workdir: Path) -> dict[str, Any]:
    """`mix` (already scaled) driven on `backend` for `seconds` after the start-up and warm-up."""
    run = f"cp-{mix.gpus}-{mix.workers}-{random.randrange(1 << 20):x}"
    dp = mix.workers // PP
    path = workdir / f"{run}.yaml"
    raw = spec(dp, "per_dc" if arm == "cluster-per-dc" else "one")
    path.write_text(yaml.safe_dump(raw))
    parsed = parse_spec(raw)
    dcs, stage_dcs = dispatch_dcs(parsed), list(placement_of(parsed).stage_dc)
    r = client_for(backend.url)
    await r.set(keys.generation_key(run), 1)
    await r.sadd(keys.generation_joined_key(run, 1), *[f"r{d}s{k}" for d in range(dp) for k in range(PP)])
    # Every slot held before the dispatchers look, for as long as the start-up may take: the workers'
    # processes start after the dispatchers (four of them in arm (c)) and renew each lease to its 3 s
    # then. Set with those 3 s, a lease could expire first, and a renewal (compare-and-renew) never
    # takes a lapsed lease back: the slot stayed lost for the whole case, every dispatcher judged the
    # run recovering and rechecked its readiness at every bubble start (arm (c) drove ~1,000 inputs/s).
    for d in range(dp):
        for k in range(PP):
            await r.set(keys.lease_key(run, d, k), HOLDER, px=int(STARTUP_LEASE_S * 1000))
    await r.aclose()
    env = {"REDIS_URL": backend.url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_RUN": run, "BUBBLETEA_TIME_SCALE": "1"}
    dispatchers = [
        await spawn(DISPATCHER, {**env, **launch.env}, out=sys.stderr, quiet=True)
        for _, launch in instances(DISPATCHER, parsed, [])
    ]
    t0 = time.time() + STARTUP_S + WARMUP_S
    window, until = (t0, t0 + seconds), t0 + seconds
    period = 1 / mix.bubbles_per_worker_s
    shape = {"period_s": period, "bubble_s": mix.bubble_fraction * period, "request_s": REQUEST_S}
    n_procs = math.ceil(mix.workers / WORKERS_PER_PROC)
    cuts = [round(i * mix.workers / n_procs) for i in range(n_procs + 1)]
    base = {"url": backend.url, "run": run, "window": window, "until": until}
    per_dc = dcs != [None]
    try:
        children = [
            await _child(
                "cp_workers.py",
                base
                | shape
                | {"first": a, "last": b, "total": mix.workers, "pp": PP, "stage_dcs": stage_dcs, "per_dc": per_dc},
            )
            for a, b in itertools.pairwise(cuts)
        ]
        front = await _child(
            "cp_front.py",
            base
            | {"rate": mix.requests_per_s, "instance": "cpbench", "prefix": "c", "seed": 1}
            | {"dcs": dcs if per_dc else None},
        )
        pids = [d.proc.pid for d in dispatchers] + [n.pid for n in backend.nodes] + [c.pid for c in children]
        pids.append(front.pid)
        await _until(window[0])
        c0, q0, k0 = (
            _cpu(pids),
            await _accepted(backend.url, run, dcs),
            await _node_info(backend.nodes, "stats", "total_commands_processed"),
        )
        await _until(window[1])
        c1, q1, k1 = (
            _cpu(pids),
            await _accepted(backend.url, run, dcs),
            await _node_info(backend.nodes, "stats", "total_commands_processed"),
        )
        outs = [json.loads((await c.communicate())[0].decode() or "{}") for c in [*children, front]]
        for d in dispatchers:
            if d.proc.returncode is not None:
                raise RuntimeError(f"a dispatcher exited ({d.proc.returncode}) during the case: its log is above")
        beat = await _heartbeats(backend.url, [d.proc.pid for d in dispatchers], after=time.time())
        memory = await _node_info(backend.nodes, "memory", "used_memory")
    finally:
        await stop_all(dispatchers)
    accepted = None if q0 is None or q1 is None else q1 - q0
    used = [b - a for a, b in zip(c0, c1, strict=True)]
    commands = [None if a is None or b is None else b - a for a, b in zip(k0, k1, strict=True)]
    return figures(arm, mix, seconds, backend, outs, accepted, used, commands, memory, beat, len(dispatchers))
