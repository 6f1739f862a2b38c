"""No accepted request is lost: a 2xx is always followed by an answer or an explicit failure.

Real processes (front door, dispatcher, WAN broker, four stage workers) over a real redis-server,
with one of them killed hard (SIGKILL) mid-run:

* the dispatcher, while requests wait for bubbles: a new dispatcher reclaims its pending requests
  and they are answered, computed in the bubbles of the still-running training;
* the front door (`prefill_queue`) right after accepting requests: a new instance reports every
  request's final status, because answers live in Redis, not in the process that accepted them;
* a stage worker while a prefill batch is in flight: in a run that checkpoints, a replacement
  takes the slot, training resumes and every request is answered (the dead worker's batch is
  requeued by the dispatcher, or handed back by the replacement); in one that does not, training
  aborts (its peers stop with an error naming the slot), and every request still ends answered or
  failed with a reason.

Every request ends "done" or "failed" with a reason (none stays "queued", none is unknown), and
every "done" answer is the token a local `PrefillModel` computes for the same prompt.

Over 300 lines on purpose: one property (no accepted request is lost) against each process kill,
with the helpers those kills share (spawning the pipeline, settling statuses, checking answers).
"""

from __future__ import annotations

import asyncio
import io
import random
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from redis.asyncio import Redis

from bubbletea.launcher.procs import Proc, front_door, spawn, start_front_door, stop_all
from bubbletea.launcher.services import DISPATCHER, STAGE_WORKER, WAN_BROKER
from shared.config.settings import load_settings
from shared.config.spec import Prefill
from shared.control import serving
from shared.model.prefill import PrefillModel
from shared.wire import IterationDone, PrefillBatch, PrefillReport, decode, keys
from tests.e2e.serving import (
    ONE_REPLICA,
    SPEC,
    service_env,
    status,
    submit,
    wait_for_an_answer,
    wait_for_iteration,
    wait_for_message,
    wait_until,
    write_spec,
)

FINAL = ("done", "failed")
# Bounds for a loaded 2-core machine: generous, and always waited on with an early exit.
#: How long every request gets to reach a final status.
SETTLE_TIMEOUT_S = 45.0
#: How long to wait for the victim worker to hold an unfinished prefill batch.
IN_FLIGHT_TIMEOUT_S = 60.0
#: The killed stage worker's run: PP=2 x DP=2, so the slot lost has a replica beside it. The kills of
#: the dispatcher and the front door run PP=2 x DP=1 (ONE_REPLICA): the workers are not their subject.
WORKERS = SPEC["parallelism"]["pp"] * SPEC["parallelism"]["dp"]
ONE_REPLICA_SLOTS = SPEC["parallelism"]["pp"]
#: For the kills that must land while requests still wait: one request per bubble, and a burst
#: far larger than the bubbles that pass while it is accepted (about 30 a second here, busy or
#: not), so the killed process always leaves requests unanswered, however slow the burst.
ONE_PER_BUBBLE = {**SPEC["bubbletea"], "max_batch_requests": 1}
BURST = 120


# --- helpers ---------------------------------------------------------------------------------


async def start_pipeline(env: dict[str, str], out: Any, slots: int) -> tuple[Proc, Proc, list[Proc]]:
    """The training side of a run, as processes: WAN broker, dispatcher, one worker per slot."""
    broker = await spawn(WAN_BROKER, env, out=out, quiet=True)
    dispatcher = await spawn(DISPATCHER, env, out=out, quiet=True)
    workers = [await spawn(STAGE_WORKER, env, out=out, quiet=True) for _ in range(slots)]
    return broker, dispatcher, workers


async def kill(p: Proc) -> None:
    """SIGKILL: no shutdown code runs, nothing is acked or handed back."""
    p.proc.kill()
    await p.proc.wait()


async def freeze_holding_a_batch(p: Proc, r: Redis, fill: str, reports: str) -> dict[str, list[str]]:
    """Stop worker `p` (SIGSTOP) at a moment it holds a prefill batch it has not finished, and
    return those batches. A pending count alone races the worker's ack: a batch that finishes
    between the look and the kill would leave nothing lost. Frozen, it can ack nothing more; an ack
    it wrote just before reaches Redis within the pause, so what is still pending after it stays.
    A worker reports a batch (on `reports`) before it acks it: one frozen between the two is
    finished for the dispatcher, not lost (a busy machine's run once froze it there), so a
    reported batch does not count as held."""
    async with asyncio.timeout(IN_FLIGHT_TIMEOUT_S):
        while True:
            while not (await r.xpending(fill, "worker"))["pending"]:  # noqa: ASYNC110
                await asyncio.sleep(0.002)  # a pending count, not an event: poll it closely
            p.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(0.05)
            done = await reported_batches(r, reports)
            held = {b: ids for b, ids in (await unfinished_batches(r, fill)).items() if b not in done}
            if held:
                return held
            p.proc.send_signal(signal.SIGCONT)  # it finished in between: look again


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
        await asyncio.sleep(0.25)  # a client polls the native API: there is no push to wait on


async def stored_statuses(redis_url: str, run: str, ids: list[str]) -> dict[str, str]:
    """Each request's status straight from Redis: "queued", "done", "failed" or "unknown"."""
    r = Redis.from_url(redis_url)
    try:
        out = {}
        for rid in ids:
            found = await serving.lookup(r, run, rid)
            out[rid] = "unknown" if found is None else found.status.value
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


async def latest_iteration(redis_url: str, run: str) -> int:
    """The highest iteration any worker of the run reported done (-1 if none yet)."""
    r = Redis.from_url(redis_url)
    try:
        entries: Any = await r.xrevrange(keys.events_stream(run), count=50)
        done = [m.iteration for _, f in entries if isinstance(m := decode(f[b"m"]), IterationDone)]
        return max(done, default=-1)
    finally:
        await r.aclose()


async def inflight(redis_url: str, run: str, settle_s: float = 5.0) -> int:
    """The run's admission count once every accepted request is final: 0 unless a ticket leaked. The
    dispatcher releases a ticket one report hop after the answer is stored, so it is polled."""
    r = Redis.from_url(redis_url)
    deadline = time.monotonic() + settle_s
    try:
        while (n := await serving.inflight(r, run)) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # a counter in Redis, not an event: poll it
        return n
    finally:
        await r.aclose()


async def no_batch_pending(redis_url: str, run: str) -> bool:
    """No worker holds an unacked prefill batch (every batch sent was run or handed back)."""
    r = Redis.from_url(redis_url)
    try:
        async for stream in r.scan_iter(match=keys.fill_stream(run, 0, 0).replace(":0:0", ":*")):
            if (await r.xpending(stream, "worker"))["pending"]:
                return False
        return True
    finally:
        await r.aclose()


async def reported_batches(r: Redis, reports: str) -> set[str]:
    """The batch ids reported on a run's prefill reports stream so far."""
    entries: Any = await r.xrange(reports, min="-", max="+")
    return {m.batch_id for _, fields in entries if isinstance(m := decode(fields[b"m"]), PrefillReport)}


async def unfinished_batches(r: Redis, fill: str) -> dict[str, list[str]]:
    """The prefill batches delivered on a worker's fill stream and never acked: their requests by
    batch id."""
    rows: Any = await r.xpending_range(fill, "worker", min="-", max="+", count=100)
    out: dict[str, list[str]] = {}
    for row in rows:
        entries: Any = await r.xrange(fill, min=row["message_id"], max=row["message_id"])
        for _, fields in entries:
            batch = decode(fields[b"m"])
            assert isinstance(batch, PrefillBatch)
            out[batch.batch_id] = [item.id for item in batch.items]
    return out


# --- a. the dispatcher ---------------------------------------------------------------------


async def test_requests_survive_a_killed_dispatcher(tmp_path: Path, redis_url: str) -> None:
    """SIGKILL the dispatcher right after a burst of requests; a new one reclaims what it held."""
    path = write_spec(
        tmp_path,
        # Long enough to outlast the successor's start-up on a loaded machine (30 iterations take
        # ~13 s here, less than a restart can take); the test stops it once everything is answered.
        **ONE_REPLICA,
        training={**SPEC["training"], "iterations": 10_000},
        bus={"claim_idle_ms": 1000},  # the successor reclaims the dead one's requests after 1 s idle
        bubbletea=ONE_PER_BUBBLE,
    )
    run = f"noloss-d-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    before, meanwhile = random_bodies(1, BURST), random_bodies(2, 10)
    procs: list[Proc] = []
    async with front_door(env, out=out) as door, aiohttp.ClientSession() as http:
        assert door.url is not None
        try:
            broker, dispatcher, workers = await start_pipeline(env, out, ONE_REPLICA_SLOTS)
            procs += [broker, dispatcher, *workers]
            await wait_for_iteration(redis_url, run, 1)
            ids_before = await submit_all(http, door.url, before)
            await kill(dispatcher)  # it holds most of the burst, unanswered: pending on the stream
            # Batches it already sent are run and answered without it (a staged one waits at most
            # HOLD_STAGED_S for its bubble); what it held but had not sent stays queued.
            await wait_until(
                lambda: no_batch_pending(redis_url, run), "the workers finished the dead dispatcher's batches"
            )
            orphaned = [rid for rid, s in (await stored_statuses(redis_url, run, ids_before)).items() if s == "queued"]
            ids_meanwhile = await submit_all(http, door.url, meanwhile)  # accepted with no dispatcher
            procs.append(await spawn(DISPATCHER, env, out=out, quiet=True))
            ids = ids_before + ids_meanwhile
            statuses = await settle(http, door.url, ids)
            # The training never noticed: its workers are alive and it goes on.
            iteration = await latest_iteration(redis_url, run)
            assert all(w.proc.returncode is None for w in workers), out.getvalue()[-4000:]
            await wait_for_iteration(redis_url, run, iteration + 1)
            left_inflight = await inflight(redis_url, run)
        finally:
            await stop_all(procs)

    print(f"\norphaned by the kill: {len(orphaned)} of {len(ids_before)}; {counts(statuses)}")
    assert_none_lost(statuses, out.getvalue())
    assert orphaned, "every request was answered before the kill: nothing was left for the successor to reclaim"
    # Bubbles went on all along: every request is answered, the orphans by the successor's dispatches.
    assert counts(statuses) == {"done": len(ids)}, f"{counts(statuses)}\n{out.getvalue()[-4000:]}"
    assert_answers_computed(settings.spec.prefill, before + meanwhile, ids, statuses)
    assert left_inflight == 0  # the admission count let every answered request go


# --- b. the front door ---------------------------------------------------------------------


async def test_requests_survive_a_killed_front_door(tmp_path: Path, redis_url: str) -> None:
    """SIGKILL the front door right after it accepted a burst; a new instance (another port)
    reports every request's final status: answers are kept in Redis, not in the accepting process."""
    path = write_spec(
        tmp_path, **ONE_REPLICA, training={**SPEC["training"], "iterations": 10_000}, bubbletea=ONE_PER_BUBBLE
    )
    run = f"noloss-q-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    bodies = random_bodies(3, BURST)
    procs: list[Proc] = []
    async with aiohttp.ClientSession() as http:
        try:
            first = await start_front_door(env, out=out)
            procs.append(first)
            assert first.url is not None
            broker, dispatcher, workers = await start_pipeline(env, out, ONE_REPLICA_SLOTS)
            procs += [broker, dispatcher, *workers]
            await wait_for_iteration(redis_url, run, 1)
            ids = await submit_all(http, first.url, bodies)
            await kill(first)
            at_kill = await stored_statuses(redis_url, run, ids)
            second = await start_front_door(env, out=out)
            procs.append(second)
            assert second.url is not None and second.url != first.url
            statuses = await settle(http, second.url, ids)
            left_inflight = await inflight(redis_url, run)
        finally:
            await stop_all(procs)

    print(f"\nat the kill: {sorted(at_kill.values()).count('queued')} of {len(ids)} queued; {counts(statuses)}")
    assert "unknown" not in at_kill.values(), at_kill
    assert "queued" in at_kill.values(), "every request was answered before the kill: not a mid-batch kill"
    assert_none_lost(statuses, out.getvalue())
    assert counts(statuses) == {"done": len(ids)}, f"{counts(statuses)}\n{out.getvalue()[-4000:]}"
    assert_answers_computed(settings.spec.prefill, bodies, ids, statuses)
    assert left_inflight == 0


# --- c. a stage worker ---------------------------------------------------------------------


@pytest.mark.parametrize("recover", [True, False], ids=["replaced", "no-checkpoints"])
async def test_requests_survive_a_killed_worker(tmp_path: Path, redis_url: str, recover: bool) -> None:
    """SIGKILL a worker while a prefill batch it was sent is unfinished.

    With checkpoints (`recover`), a replacement worker is started: the run pauses, resumes, and
    every request taken is answered, the dead worker's batch coming back (requeued by the
    dispatcher, or handed back by the replacement, which re-reads it) and run elsewhere. While the
    run waits for the replacement, new requests are refused with 503 and Retry-After 5 s (the
    replacement might never come), not queued to wait out their deadline; once it resumed they
    are taken again.

    Without, the run aborts, and every request still ends answered or failed with the reason: at
    once once the dispatcher sees the run stopped (`unavailable`, naming the lost slot), or at its
    deadline if that came first. From then on new requests are refused at once with 503 and the
    same reason."""
    deadline_ms = 60_000 if recover else 8000
    training = {**SPEC["training"], "iterations": 10_000, "checkpoint_every": 2 if recover else 0}
    path = write_spec(tmp_path, training=training)
    run = f"noloss-w-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    dispatcher_out = io.StringIO()
    replacement_out = io.StringIO()  # every line (info included) of the replacement worker
    rng = random.Random(4)
    bodies: list[dict[str, Any]] = []
    ids: list[str] = []
    refused: list[dict[str, Any]] = []
    procs: list[Proc] = []
    stop_submitting = asyncio.Event()

    async def keep_submitting(http: aiohttp.ClientSession, url: str) -> None:
        """A steady trickle, so batches are in flight whenever the worker dies (once the run is
        known to be stopped, the front door refuses them: those are kept to check the refusal)."""
        i = 0
        while not stop_submitting.is_set():
            body = {"prompt": [rng.randrange(256) for _ in range(rng.randint(1, 128))], "deadline_ms": deadline_ms}
            if i % 3 == 0:
                body |= {"temperature": 0.8, "seed": i}
            async with http.post(f"{url}/v1/prefill", json=body) as resp:
                if resp.status == 503:
                    refused.append({"retry_after": resp.headers.get("Retry-After"), **await resp.json()})
                else:
                    assert resp.status == 202, await resp.text()
                    bodies.append(body)
                    ids.append((await resp.json())["id"])
            i += 1
            await asyncio.sleep(0.02)  # arrivals spread over the run (load shape, not a wait)

    # The dead worker's batch comes back by one of two paths, whichever is first: the dispatcher
    # gives up waiting for its report and requeues it, or the replacement (the same slot, so the
    # same consumer name) re-reads it as its own pending entry and hands it back unrun.
    slot, lost = "", dict[str, list[str]]()  # set once the victim is chosen
    timeline = ""  # how long recovery took, for the failure messages

    def requeued_by_dispatcher() -> bool:
        lines = dispatcher_out.getvalue().splitlines()
        return any("batch never reported back" in line and f"worker={slot}" in line for line in lines)

    def handed_back_by_replacement() -> bool:
        lines = replacement_out.getvalue().splitlines()
        return any(
            "delivered again" in line and "action=return" in line and f"batch={b}" in line
            for b in lost
            for line in lines
        )

    async def batch_came_back() -> bool:
        return requeued_by_dispatcher() or (recover and handed_back_by_replacement())

    r = Redis.from_url(redis_url)
    submitter: asyncio.Task[None] | None = None
    async with front_door(env, out=out) as door, aiohttp.ClientSession() as http:
        assert door.url is not None
        try:
            broker = await spawn(WAN_BROKER, env, out=out, quiet=True)
            dispatcher = await spawn(DISPATCHER, env, out=dispatcher_out, quiet=True)
            workers = [await spawn(STAGE_WORKER, env, out=out, quiet=True) for _ in range(WORKERS)]
            procs += [broker, dispatcher, *workers]
            await wait_for_iteration(redis_url, run, 1)
            submitter = asyncio.create_task(keep_submitting(http, door.url))
            await wait_for_an_answer(redis_url, run)  # requests are being answered: now kill mid-batch
            victim, survivors = workers[0], workers[1:]
            slot = slot_of(victim)
            replica, stage = (int(x) for x in re.fullmatch(r"r(\d+)s(\d+)", slot).groups())  # type: ignore[union-attr]
            fill = keys.fill_stream(run, replica, stage)
            # Kill it the moment it holds a batch it has not finished (delivered, not acked).
            lost = await freeze_holding_a_batch(victim, r, fill, keys.prefill_reports_stream(run))
            await kill(victim)
            killed_at = time.monotonic()
            lost_ids = [rid for ids_ in lost.values() for rid in ids_]
            if recover:
                procs.append(await spawn(STAGE_WORKER, env, out=replacement_out))
                await wait_for_resumed_training(redis_url, run)
                timeline += f"resumed {time.monotonic() - killed_at:.1f}s after the kill; "
                resumed_at = len(ids)

                async def accepted_since() -> bool:
                    return len(ids) > resumed_at + 20

                await wait_until(accepted_since, "requests accepted after the resumption")
                codes = [p.proc.returncode for p in survivors]  # still training
            else:
                codes = await asyncio.wait_for(asyncio.gather(*(p.proc.wait() for p in survivors)), 60)
            stop_submitting.set()
            await submitter
            if not recover:  # the dispatcher's verdict follows the survivors' exit by one of its reads

                async def refusing() -> bool:
                    async with http.get(f"{door.url}/ready") as resp:
                        return resp.status == 503

                await wait_until(refusing, "/ready answering 503 once the run stopped")
            # Resumed: a new request is answered. Stopped: no bubble will ever come, so a new
            # request is refused at once, saying why.
            async with http.post(f"{door.url}/v1/prefill", json={"prompt": [1, 2, 3]}) as resp:
                late = (resp.status, resp.headers.get("Retry-After"), await resp.json())
            late_ids = [late[2]["id"]] if late[0] == 202 else []
            statuses = await settle(http, door.url, ids + late_ids, timeout=deadline_ms / 1000 + 30)
            timeline += f"settled {time.monotonic() - killed_at:.1f}s after it"
            left_inflight = await inflight(redis_url, run)
            # The requests may all be final before the batch is declared lost (a stopped run fails
            # what waits at once): give the dispatcher until the report is overdue to say so (its
            # grace is 3 s past the prediction; 30 s leaves room for a machine with a core kept
            # busy, where 15 s once ran out with nothing lost: every request had settled).
            try:
                await wait_until(batch_came_back, "the dead worker's batch requeued or handed back", timeout=30)
            except AssertionError as exc:  # say what the dispatcher and the replacement did instead
                said = (dispatcher_out.getvalue() + replacement_out.getvalue()).splitlines()
                about = [ln for ln in said if any(b in ln for b in lost) or "never reported" in ln]
                raise AssertionError(f"{exc}: lost {lost}; {timeline}\n" + "\n".join(about[-20:])) from None
        finally:
            if submitter is not None and not submitter.done():
                submitter.cancel()
                await asyncio.gather(submitter, return_exceptions=True)
            await stop_all(procs)
            await r.aclose()

    log = out.getvalue() + dispatcher_out.getvalue() + replacement_out.getvalue()
    print(f"\nkilled {slot} holding {lost_ids}; survivors' exit codes {codes}; {counts(statuses)}; {timeline}")
    print("failures:", sorted({s["error"].split(" in the queue")[0] for s in statuses.values() if "error" in s}))
    assert lost_ids, "the killed worker held no unfinished batch: the kill was not mid-batch"
    print(f"requeued by the dispatcher: {requeued_by_dispatcher()}; handed back: {handed_back_by_replacement()}")
    assert_none_lost(statuses, log)
    assert all(statuses[rid]["status"] in FINAL for rid in lost_ids)
    assert_answers_computed(settings.spec.prefill, bodies, ids, statuses)
    assert left_inflight == 0
    status, retry_after, body = late
    if recover:
        assert codes == [None, None, None], log[-4000:]  # the survivors paused and resumed: none exited
        # refused only while it waited for the replacement: 503, come back in 5 s, saying so
        assert all(x["retry_after"] == "5" and "new ones are refused" in str(x) for x in refused), refused[:3]
        # every one answered (the late one too), none failed
        failed = [s for s in statuses.values() if s["status"] != "done"]
        assert not failed, f"{counts(statuses)}; not done: {failed[:3]}; {timeline}\n{log[-4000:]}"
        assert status == 202, body
        return
    # The run stopped with an error naming the dead worker's slot; nobody hangs.
    assert codes == [1, 1, 1]
    for p in survivors:
        assert any(f"slot {slot} lost its worker" in line for line in p.tail), "\n".join(p.tail)
    # Failed only because the run stopped, or (first) for its deadline: passed in the queue, or
    # refused on arrival because the prefill queued ahead would take past it (overloaded).
    for s in statuses.values():
        if s["status"] == "failed" and s["reason"] == "unavailable":
            assert f"slot {slot} lost its worker" in s["error"], s
        else:
            assert s["status"] == "done" or s["reason"] in ("deadline", "overloaded"), s
    # Before the kill requests were answered, really computed; after it, nothing can be.
    assert counts(statuses).get("done", 0) > 0
    assert status == 503 and retry_after == "30", body
    assert f"slot {slot} lost its worker" in body["error"]["message"], body
    for r_ in refused:
        assert r_["retry_after"] is not None and "not serving" in r_["error"]["message"], r_


async def wait_for_resumed_training(redis_url: str, run: str, timeout: float = 90.0) -> None:
    """Block on the run's events until an iteration of a later recovery generation is done."""
    first: list[int] = []

    def resumed(msg: Any) -> bool:
        if not isinstance(msg, IterationDone):
            return False
        first.append(msg.generation) if not first else None
        return msg.generation > first[0]

    await wait_for_message(redis_url, keys.events_stream(run), resumed, f"run {run} resuming", timeout)
