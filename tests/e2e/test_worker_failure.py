"""A worker that dies mid-run, in a run that cannot recover (no checkpoints, or no replacement in
time), stops the run with an error naming its slot; nobody hangs. (A run that checkpoints and gets a
replacement resumes: test_worker_recovery.py.)"""

from __future__ import annotations

import asyncio
import io
import re
import uuid
from pathlib import Path

import pytest
import yaml

from bubbletea.launcher.procs import spawn, stop_all
from bubbletea.launcher.services import STAGE_WORKER, WAN_BROKER
from shared.bus.connection import blocking_client
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import IterationDone, decode, keys
from tests.e2e.serving import replicas

SPEC = {
    "datacenters": [{"name": "dc-a", "gpus": 2}, {"name": "dc-b", "gpus": 2}],
    "wan": {"default": {"latency_ms": 2}},
    "model": {"layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
    "parallelism": {"pp": 2, "dp": 2},
    "training": {"microbatches": 2, "microbatch_size": 1, "iterations": 100_000, "checkpoint_every": 0},
    "device": {"fwd_ms_per_layer": 5},
}


@pytest.mark.parametrize(
    ("training", "dp", "says"),
    [
        # the other replica's workers stop too
        ({"checkpoint_every": 0}, 2, "slot {slot} lost its worker"),
        # checkpoints, but nobody replaces the dead worker: the peers give up after the timeout (one
        # replica: the timeout is the subject)
        ({"checkpoint_every": 1, "recovery_timeout_s": 3}, 1, "waiting for workers of slots {slot} to join"),
    ],
)
async def test_killed_worker_stops_the_run_naming_its_slot(
    tmp_path: Path, redis_server: EmbeddedRedis, training: dict[str, float], dp: int, says: str
) -> None:
    spec = tmp_path / "spec.yaml"
    training = {**SPEC["training"], **training}  # type: ignore[dict-item]
    spec.write_text(yaml.safe_dump({**SPEC, **replicas(SPEC, dp), "training": training}))
    env = {"REDIS_URL": redis_server.url, "BUBBLETEA_CONFIG": str(spec), "BUBBLETEA_RUN": f"f{uuid.uuid4().hex[:6]}"}
    procs = [await spawn(WAN_BROKER, env, out=io.StringIO())]
    procs += [await spawn(STAGE_WORKER, env, out=io.StringIO()) for _ in range(2 * dp)]
    workers = procs[1:]
    try:
        # wait until training is under way: block on the run's events for a second iteration
        r = blocking_client(redis_server.url)  # no socket timeout cutting the long blocking read
        cursor = "0"
        while True:
            reply = await r.xread({keys.events_stream(env["BUBBLETEA_RUN"]): cursor}, block=120_000)
            assert reply, "training never started"
            cursor = reply[0][1][-1][0]
            if any(isinstance(m := decode(f[b"m"]), IterationDone) and m.iteration >= 1 for _, f in reply[0][1]):
                break
        await r.aclose()
        victim = workers[0]
        slot = next(m.group(1) for line in victim.tail if (m := re.search(r"slot leased.*slot=(r\d+s\d+)", line)))
        victim.proc.kill()
        survivors = workers[1:]
        codes = await asyncio.wait_for(asyncio.gather(*(p.proc.wait() for p in survivors)), 30)
        assert codes == [1] * len(survivors)  # each stopped with an error instead of hanging
        for p in survivors:
            assert any(says.format(slot=slot) in line for line in p.tail), "\n".join(p.tail)
    finally:
        await stop_all(procs)
