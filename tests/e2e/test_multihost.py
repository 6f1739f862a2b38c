"""Multi-host, as docs/deploy.md tells it, with network namespaces as the hosts.

The control host (this namespace) runs Redis and the WAN broker; each datacenter is a namespace
of its own (a "host" with its own address), whose stage workers are started exactly as the
document says: `BUBBLETEA_WAN=none`, `BUBBLETEA_DC=<its datacenter>`, `BUBBLETEA_PLANE_HOST=<its
address>`, `REDIS_URL` at the control host's address. The losses equal single-process training
(within float rounding of its other summation order).

Needs root and network namespaces: skipped otherwise, with the reason.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import yaml
from redis.asyncio import Redis

from bubbletea.launcher.kernel_wan import KernelWanError, check_privileges, kernel_wan
from shared.config.spec import load_spec
from shared.dataplane.kernel_net import plan_kernel_net
from shared.model.reference import train_reference_for
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import IterationDone, decode, keys

# Kernel WANs share the host (namespaces, addresses, ip_forward): one such test at a time (conftest).
pytestmark = [pytest.mark.kernel_wan]

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "name": "multihost",
    "datacenters": [{"name": "dc-a", "gpus": 2}, {"name": "dc-b", "gpus": 2}],
    # a fast link: this test is about where processes run and how they meet, not about shaping
    "wan": {"sharing": "temporal", "default": {"latency_ms": 1, "bandwidth_gbps": 1, "connections": 2}},
    "model": {"layers": 4, "d_model": 32, "heads": 4, "seq_len": 16, "vocab": 256, "seed": 3},
    "parallelism": {"pp": 2, "dp": 2, "tp": 1},
    "device": {"kind": "cpu"},
    "training": {"schedule": "1f1b", "microbatches": 3, "microbatch_size": 2, "iterations": 4, "lr": 3e-3, "seed": 7},
}


def _privileged() -> str | None:
    try:
        check_privileges()
    except KernelWanError as exc:
        return str(exc)
    return None


async def test_workers_on_two_hosts_train_over_the_real_network(tmp_path: Path) -> None:
    if (why := _privileged()) is not None:
        pytest.skip(f"needs root and network namespaces to stand in for hosts: {why}")
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    spec = load_spec(spec_path)
    run = f"mh{os.getpid()}"
    plan = plan_kernel_net(spec, run, base="10.79")
    redis = EmbeddedRedis().start()
    procs: list[asyncio.subprocess.Process] = []
    try:
        async with kernel_wan(plan):
            admin = Redis.from_url(redis.url, protocol=2)
            controls = [plan.control_address(dc.name) for dc in spec.datacenters]
            await admin.config_set("bind", " ".join(["127.0.0.1", *controls]))
            await admin.config_set("protected-mode", "no")
            common = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "BUBBLETEA_CONFIG": str(spec_path),
                "BUBBLETEA_RUN": run,
                "BUBBLETEA_WAN": "none",
            }
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "services.wan_broker", env={**common, "REDIS_URL": redis.url}, cwd=ROOT
                )
            )
            for dc in plan.dcs:  # two stage workers per DC "host"
                host = dc.workers[0][0]
                env = {
                    **common,
                    "REDIS_URL": f"redis://{dc.control_address}:{redis.port}/0",
                    "BUBBLETEA_DC": dc.name,
                    "BUBBLETEA_PLANE_HOST": host,
                }
                for _ in range(2):
                    procs.append(
                        await asyncio.create_subprocess_exec(
                            *plan.netns_prefix(dc.name),
                            sys.executable,
                            "-m",
                            "services.stage_worker",
                            env=env,
                            cwd=ROOT,
                        )
                    )
            losses = await _losses(admin, run, spec.training.iterations, stage=1, timeout_s=180)
            workers = procs[1:]
            codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in workers)), 60)
            assert codes == [0, 0, 0, 0]
            spans = await admin.xlen(keys.spans_stream(run))
            await admin.aclose()
    finally:
        for p in procs:
            if p.returncode is None:
                p.terminate()
        await asyncio.gather(*(p.wait() for p in procs), return_exceptions=True)
        redis.stop()
    expected, _ = train_reference_for(spec)
    # the reference sums in another order (all microbatches into one model): rounding only
    assert losses == pytest.approx(expected, abs=1e-5)
    assert expected[-1] < expected[0] and spans > 0


async def _losses(r: Redis, run: str, iterations: int, *, stage: int, timeout_s: float) -> list[float]:
    """Each iteration's loss: the mean of the last stage's replicas, as `bubbletea train` reports."""
    deadline = time.monotonic() + timeout_s
    per_it: dict[int, dict[int, float]] = {}
    last = "0"
    while sum(len(v) == 2 for v in per_it.values()) < iterations:
        assert time.monotonic() < deadline, f"training did not finish: {per_it}"
        for _, entries in await r.xread({keys.events_stream(run): last}, block=1000) or []:
            for entry_id, fields in entries:
                last = entry_id
                m = decode(fields[b"m"])
                if isinstance(m, IterationDone) and m.stage == stage and m.loss is not None:
                    per_it.setdefault(m.iteration, {})[m.replica] = m.loss
    return [statistics.fmean(per_it[i].values()) for i in range(iterations)]
