"""No accepted request is lost: a 2xx is always followed by an answer or an explicit failure.

Real processes (front door, dispatcher, WAN broker, four stage workers) over a real redis-server,
with one of them killed hard (SIGKILL) mid-run:

* the dispatcher, while requests wait for bubbles: a new dispatcher reclaims its pending requests
  and they are answered, computed in the bubbles of the still-running training;
* the front door (`prefill_queue`) right after accepting requests: a new instance reports every
  request's final status, because answers live in Redis, not in the process that accepted them;
* a stage worker while a prefill batch is in flight: training aborts (its peers stop with an error
  naming the slot), and every request still ends answered or failed at its deadline with a reason.

Every request ends "done" or "failed" with a reason (none stays "queued", none is unknown), and
every "done" answer is the token a local `PrefillModel` computes for the same prompt.
"""

from __future__ import annotations

import asyncio
import io
import random
import re
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from redis.asyncio import Redis

from shared import keys, serving
from shared.bus.connection import blocking_client
from shared.config import Prefill
from shared.launcher.procs import Proc, spawn, stop_all
from shared.launcher.services import DISPATCHER, STAGE_WORKER, WAN_BROKER
from shared.model.prefill import PrefillModel
from shared.settings import load_settings
from shared.wire import IterationDone, WorkerFailed, decode
from tests.e2e.serving import SPEC, front_door, service_env, start_front_door, status, submit, write_spec

pytestmark = pytest.mark.e2e

FINAL = ("done", "failed")
#: Bounds for a loaded 2-core machine: generous, and only ever waited on with early exits.
START_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 45.0
WORKERS = SPEC["parallelism"]["pp"] * SPEC["parallelism"]["dp"]


# --- helpers ---------------------------------------------------------------------------------


async def start_pipeline(env: dict[str, str], out: Any) -> tuple[Proc, Proc, list[Proc]]:
    """The training side of a run, as processes: WAN broker, dispatcher, one worker per slot."""
    broker = await spawn(WAN_BROKER, env, out=out, quiet=True)
    dispatcher = await spawn(DISPATCHER, env, out=out, quiet=True)
    workers = [await spawn(STAGE_WORKER, env, out=out, quiet=True) for _ in range(WORKERS)]
    return broker, dispatcher, workers


async def kill(p: Proc) -> None:
    """SIGKILL: no shutdown code runs, nothing is acked or handed back."""
    p.proc.kill()
    await p.proc.wait()


async def wait_for_iteration(redis_url: str, run: str, iteration: int, timeout: float = START_TIMEOUT_S) -> None:
    """Block on the run's events until some worker finished `iteration` (training is under way)."""
    r = blocking_client(redis_url)
    cursor, deadline = "0", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            reply: Any = await r.xread({keys.events_stream(run): cursor}, block=1000)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    msg = decode(fields[b"m"])
                    assert not isinstance(msg, WorkerFailed), f"training failed: {msg}"
                    if isinstance(msg, IterationDone) and msg.iteration >= iteration:
                        return
        raise AssertionError(f"run {run} did not reach iteration {iteration} within {timeout:.0f}s")
    finally:
        await r.aclose()


def slot_of(p: Proc) -> str:
    """The slot a worker process leased, from its log."""
    for line in p.tail:
        if m := re.search(r"slot leased.*slot=(r\d+s\d+)", line):
            return m.group(1)
    raise AssertionError("the worker logged no leased slot:\n" + "\n".join(p.tail))


def random_bodies(seed: int, n: int, **extra: Any) -> list[dict[str, Any]]:
    """Prompts of 1..128 byte tokens; every third one sampled with a seed, the rest greedy."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 128))]
        sampling = {"temperature": 0.8, "seed": seed * 1000 + i} if i % 3 == 0 else {}
        bodies.append({"prompt": prompt, "logprobs": 2, **sampling, **extra})
    return bodies


async def submit_all(http: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]]) -> list[str]:
    """Submit concurrently (a burst); each must be accepted with a 202."""
    return list(await asyncio.gather(*(submit(http, url, b) for b in bodies)))


async def settle(
    http: aiohttp.ClientSession, url: str, ids: list[str], timeout: float = SETTLE_TIMEOUT_S
) -> dict[str, dict[str, Any]]:
    """Poll every request's status until all are final or `timeout` passes; the last statuses."""
    last: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while True:
        for rid in ids:
            if last.get(rid, {}).get("status") not in FINAL:
                last[rid] = await status(http, url, rid)  # asserts 200: a 404 (vanished) fails here
        if all(s["status"] in FINAL for s in last.values()) or time.monotonic() > deadline:
            return last
        await asyncio.sleep(0.25)


async def stored_statuses(redis_url: str, ids: list[str]) -> dict[str, str]:
    """Each request's status straight from Redis: "queued", "done", "failed" or "unknown"."""
    r = Redis.from_url(redis_url)
    try:
        out = {}
        for rid in ids:
            found = await serving.lookup(r, rid)
            if found is None:
                out[rid] = "unknown"
            elif isinstance(found, str):
                out[rid] = found
            else:
                out[rid] = "done" if found.ok else "failed"
        return out
    finally:
        await r.aclose()


def assert_none_lost(statuses: dict[str, dict[str, Any]], log: str) -> None:
    """Every request is final; a failure carries its reason."""
    open_ = {rid: s for rid, s in statuses.items() if s["status"] not in FINAL}
    assert not open_, f"{len(open_)} of {len(statuses)} requests never ended: {list(open_.values())[:3]}\n{log[-4000:]}"
    for s in statuses.values():
        if s["status"] == "failed":
            assert isinstance(s.get("error"), str) and s["error"], f"a failure without a reason: {s}"


def assert_answers_computed(
    prefill: Prefill, bodies: list[dict[str, Any]], ids: list[str], statuses: dict[str, dict[str, Any]]
) -> None:
    """Every "done" answer is what a local prefill of the same prompt computes."""
    model = PrefillModel.from_spec(prefill)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        for rid, body in zip(ids, bodies, strict=True):
            s = statuses[rid]
            if s["status"] != "done":
                continue
            want = model.prefill(
                body["prompt"], temperature=body.get("temperature", 0.0), seed=body.get("seed"), top_logprobs=2
            )
            got = s["result"]
            assert got["token"] == want.token, f"{rid}: {got} != {want.token}"
            assert got["logprob"] == pytest.approx(want.logprob, abs=1e-5)
            assert got["prompt_tokens"] == len(body["prompt"])
    finally:
        torch.set_num_threads(threads)


def counts(statuses: dict[str, dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in statuses.values():
        out[s["status"]] = out.get(s["status"], 0) + 1
    return out


# --- a. the dispatcher ---------------------------------------------------------------------


async def test_requests_survive_a_killed_dispatcher(tmp_path: Path, redis_url: str) -> None:
    """SIGKILL the dispatcher right after a burst of requests; a new one reclaims what it held."""
    path = write_spec(
        tmp_path,
        training={**SPEC["training"], "iterations": 30},
        bus={"claim_idle_ms": 1000},  # the successor reclaims the dead one's requests after 1 s idle
    )
    run = f"noloss-d-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    before, during = random_bodies(1, 60), random_bodies(2, 10)
    procs: list[Proc] = []
    t0 = time.monotonic()
    async with front_door(env, out) as door, aiohttp.ClientSession() as http:
        assert door.url is not None
        try:
            broker, dispatcher, workers = await start_pipeline(env, out)
            procs += [broker, dispatcher, *workers]
            await wait_for_iteration(redis_url, run, 1)
            t_train = time.monotonic()
            ids_before = await submit_all(http, door.url, before)
            await kill(dispatcher)
            t_kill = time.monotonic()
            # Batches it already sent run and are answered without it (a staged batch waits at
            # most HOLD_STAGED_S for its bubble); what it held but had not sent stays queued.
            await asyncio.sleep(2.5)
            orphaned = [rid for rid, s in (await stored_statuses(redis_url, ids_before)).items() if s == "queued"]
            ids_during = await submit_all(http, door.url, during)  # no dispatcher: they wait on the stream
            successor = await spawn(DISPATCHER, env, out=out, quiet=True)
            procs.append(successor)
            t_restart = time.monotonic()
            ids = ids_before + ids_during
            statuses = await settle(http, door.url, ids)
            t_settled = time.monotonic()
            if any(v["status"] not in FINAL for v in statuses.values()):
                from shared.health import live_instances
                rr = Redis.from_url(redis_url)
                print("DEBUG live", await live_instances(rr, "dispatcher"))
                print("DEBUG xpending", await rr.xpending(keys.PREFILL_REQUESTS_STREAM, "dispatcher"))
                print("DEBUG groups", await rr.xinfo_groups(keys.bubbles_stream(run)))
                await rr.aclose()
                print("DEBUG successor rc", successor.proc.returncode, "\n".join(successor.tail))
            print(
                f"\n[dispatcher] start->iter1 {t_train - t0:.1f}s  kill at +{t_kill - t_train:.2f}s  "
                f"orphaned {len(orphaned)}/{len(ids_before)}  restart->settled {t_settled - t_restart:.1f}s  "
                f"{counts(statuses)}"
            )
            # the training was never disturbed: it runs on to the end, as if nothing happened
            codes = await asyncio.wait_for(asyncio.gather(*(w.proc.wait() for w in workers)), 120)
            print(f"[dispatcher] training done at +{time.monotonic() - t0:.1f}s, codes {codes}")
        finally:
            await stop_all(procs)

    assert_none_lost(statuses, out.getvalue())
    assert orphaned, "every request was answered before the kill: nothing was left for the successor to reclaim"
    # No bubbles were missing: everything is answered, the orphans by the successor's dispatches.
    assert counts(statuses) == {"done": len(ids)}, f"{counts(statuses)}\n{out.getvalue()[-4000:]}"
    assert all(statuses[rid]["status"] == "done" for rid in orphaned)
    assert_answers_computed(settings.spec.prefill, before + during, ids, statuses)
