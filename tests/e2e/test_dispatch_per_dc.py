"""A dispatcher per datacenter (`bubbletea.dispatch: per_dc`), live: real processes (the front door,
the WAN broker, a dispatcher for each of the two datacenters, two stage workers) over a real
redis-server, and the official `openai` client.

Each dispatcher leads its own datacenter's lease and reads only its datacenter's streams; the
front door routes each request to one of them on their snapshots; every answer is the token a
local `PrefillModel` computes for the prompt, whichever datacenter's bubbles ran it.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from pathlib import Path
from typing import Any

import torch
from openai import AsyncOpenAI
from redis.asyncio import Redis

from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import run_training
from shared.bus.connection import client_for
from shared.config.settings import load_settings
from shared.control import verdicts
from shared.model.prefill import PrefillModel
from shared.model.tokenizer import encode as encode_text
from shared.policies.pipeline_plan import dispatch_dcs
from shared.wire import keys
from shared.wire.status import ServingState
from tests.e2e.serving import ONE_REPLICA, SPEC, service_env, wait_for_iteration, write_spec

#: A generous bound for a loaded 2-core machine (a completion waits for a bubble).
REQUEST_TIMEOUT_S = 60.0
#: Training goes on until the test has its answers and stops it.
UNTIL_DONE = 100_000
PROMPTS = [f"prompt number {i}" for i in range(8)]


async def entries_added(r: Redis, stream: str) -> int:
    """Requests ever queued on `stream` (XINFO's entries-added: the dispatcher trims what it read)."""
    if not await r.exists(stream):
        return 0
    info: Any = await r.xinfo_stream(stream)
    return int(info["entries-added"])


async def test_a_dispatcher_per_datacenter_serves_what_the_front_door_routes_to_each(
    tmp_path: Path, redis_url: str
) -> None:
    path = write_spec(
        tmp_path,
        **ONE_REPLICA,
        training={**SPEC["training"], "iterations": UNTIL_DONE},
        bubbletea={**SPEC["bubbletea"], "dispatch": "per_dc"},
    )
    run = f"perdc-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    dcs = [dc for dc in dispatch_dcs(settings.spec) if dc is not None]
    assert len(dcs) == 2  # a stage in each datacenter
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    r = client_for(redis_url)  # one redis-server, or the cluster pass's (`make test`)
    async with front_door(env, out=out) as door:
        assert door.url is not None
        training = asyncio.create_task(run_training(settings, redis_url, out=out, progress=False, dispatcher=True))
        client = AsyncOpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        try:
            await wait_for_iteration(redis_url, run, 1)
            model = settings.spec.prefill.model_name
            try:
                got = await asyncio.gather(
                    *(client.completions.create(model=model, prompt=p, max_tokens=1, temperature=0) for p in PROMPTS)
                )
            except Exception as exc:  # failed: the services' logs say why
                raise AssertionError(f"{exc!r}\n{out.getvalue()[-6000:]}") from None
            leaders = [await r.get(keys.dispatcher_lease_key(run, dc)) for dc in dcs]
            boards = [await r.get(keys.dc_snapshot_key(run, dc)) for dc in dcs]
            states = {v.instance: v.state for v in await verdicts.readiness(r, run)}
            routed = [await entries_added(r, keys.prefill_requests_stream(run, dc)) for dc in dcs]
            reported = [await entries_added(r, keys.prefill_reports_stream(run, dc)) for dc in dcs]
            run_wide = [
                await entries_added(r, keys.prefill_requests_stream(run)),
                await entries_added(r, keys.bubbles_stream(run)),
                await r.exists(keys.dispatcher_lease_key(run)),
            ]
            assert not training.done(), out.getvalue()[-3000:]  # it trained throughout, without failing
        finally:
            await client.close()
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            await r.aclose()

    # each datacenter led by its own dispatcher, each saying it serves; nothing on the run-wide
    # streams or lease
    assert all(leaders) and len(set(leaders)) == 2, leaders
    assert states == {leader.decode(): ServingState.SERVING for leader in leaders if leader}, states
    assert run_wide == [0, 0, 0]
    # every request queued on one datacenter's stream, and both were used (a burst spreads: the
    # front door counts what it routed until the next snapshot)
    assert sum(routed) == len(PROMPTS) and min(routed) > 0, (routed, boards)
    assert min(reported) > 0, reported  # each datacenter's workers reported to their dispatcher

    prefill = PrefillModel.from_spec(settings.spec.prefill)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        want = [prefill.prefill(encode_text(p), temperature=0.0).text for p in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    assert [c.choices[0].text for c in got] == want
