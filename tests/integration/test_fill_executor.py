"""The worker's fill executor against a real Redis and a real prefill model.

Preemption: when training input arrives mid-prefill, at most the block already running finishes;
the unfinished request is snapshotted at the layer it reached, reported, and a later bubble (here:
a second `fill`) resumes it to exactly the answer of one uninterrupted prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from services.stage_worker import port_prefill
from services.stage_worker.filler import Filler
from services.stage_worker.mailbox import Mailbox
from services.stage_worker.port import ELSEWHERE, LOST, PrefillPort, StagePort
from shared.bus import Bus, Delivery, Reject
from shared.control import keys, serving
from shared.control.status import ItemOutcome, RequestStatus
from shared.dataplane import kvstore
from shared.model.gpt import GPTConfig
from shared.model.prefill import PrefillModel, PrefillState
from shared.policies.fill import FillPolicy
from shared.spec.config import BusConfig
from shared.wire import PrefillBatch, PrefillItem, PrefillReport, PrefillRequest, decode

pytestmark = pytest.mark.integration

RUN = "fill"
LAYERS = 24
CFG = GPTConfig(layers=LAYERS, d_model=64, heads=4, seq_len=256, vocab=256)
PROMPT = tuple(range(7, 7 + 200))


def batch(item: PrefillItem, n: int, *, hold: bool = False) -> PrefillBatch:
    return PrefillBatch(run=RUN, worker="r0s0", batch_id=f"b{n}", items=(item,), hold=hold)


def filler_for(bus: Bus, model: PrefillModel, *, run: str = RUN, kv_ttl_s: int = 0, **kw: Any) -> Filler:
    spans = kw.pop("on_span", lambda a, b: None)
    port = StagePort(PrefillPort(bus.redis, run, kv_ttl_s))
    return Filler(bus, run, "r0s0", model, "m", port, spans, FillPolicy(guard_s=0.0, **kw))


@contextlib.contextmanager
def arriving_during_block(model: PrefillModel, block: int, arrive: Callable[[], None]) -> Iterator[None]:
    """Meanwhile `arrive()` runs on the event loop once block `block` of `model` has started, and
    the block waits for it: training input that lands while that block runs, however the host
    schedules the loop and the prefill thread (its arrival is the test's input, not a race). A
    batch's first block runs on the event loop itself: there the input lands directly."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    run_layers = model.run_layers

    def run_block(state: PrefillState, *args: Any, **kw: Any) -> PrefillState:
        if state.next_layer == block and threading.get_ident() == loop_thread:
            arrive()
        elif state.next_layer == block:
            landed = threading.Event()

            def land() -> None:
                arrive()
                landed.set()

            loop.call_soon_threadsafe(land)
            assert landed.wait(60), "the event loop never took the training input"
        return run_layers(state, *args, **kw)

    model.run_layers = run_block  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.run_layers  # the class's method again


async def one_bubble(
    filler: Filler, b: PrefillBatch, *, arrive_during_block: int | None, model: PrefillModel
) -> tuple[list[float], float | None]:
    """Run one bubble with `b` queued; training input arrives while block `arrive_during_block` of
    `model` runs (None: once the batch is done and reported). Returns the times the batch checked
    for input (once before each block: the first in the event loop, the rest in the prefill thread),
    and the arrival time."""
    mailbox, key = Mailbox(), ("grad", 0, 0)
    checks: list[float] = []
    put_at: float | None = None

    def put() -> None:
        nonlocal put_at
        put_at = time.perf_counter()
        mailbox.put(key, torch.zeros(1))

    def arrived() -> bool:
        if sys._getframe(1).f_code.co_name == "_run_blocks":  # not the fill loop's own checks between batches
            checks.append(time.perf_counter())
        return mailbox.arrived(key)

    with contextlib.ExitStack() as stack:
        if arrive_during_block is not None:
            stack.enter_context(arriving_during_block(model, arrive_during_block, put))
        take = asyncio.ensure_future(mailbox.take(key))
        # a long bubble: only the training input's arrival stops the prefill, never its predicted end
        fill = asyncio.create_task(filler.fill(arrived, take, predicted_s=600.0, started=time.monotonic()))
        handled = asyncio.create_task(filler.on_batch(Delivery("1-0", "s", b, 1)))
        if arrive_during_block is None:
            await asyncio.wait_for(handled, 60)  # done and reported (the report is sent before the batch is acked)
            put()
        await asyncio.wait_for(fill, 60)
        await asyncio.wait_for(handled, 60)
        await take
    return checks, put_at


async def reports(bus: Bus) -> list[PrefillReport]:
    rows: Any = await bus.redis.xrange(keys.prefill_reports_stream(RUN))
    return [m for _, f in rows if isinstance(m := decode(f[b"m"]), PrefillReport)]


async def test_training_input_preempts_at_the_next_layer_and_the_rest_resumes_exactly(redis_url: str) -> None:
    torch.set_num_threads(1)
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = PrefillRequest(id="req-1", model="m", tokens=PROMPT, submitted=time.time(), reply_to="bt:test:results")
        assert await serving.accept(bus.redis, req, 100)
        spans: list[tuple[float, float]] = []
        filler = filler_for(bus, model, kv_ttl_s=60, on_span=lambda a, b: spans.append((a, b)))

        # Bubble 1: the grad arrives while the prefill is running (in its ninth block of 24).
        item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
        during = LAYERS // 3
        checks, put_at = await one_bubble(filler, batch(item, 1), arrive_during_block=during, model=model)
        (first,) = await reports(bus)
        (p,) = first.progress
        assert first.preempted and p.outcome is ItemOutcome.PARTIAL
        # The batch checks before each block: blocks started before the arrival = checks
        # before it. The block in progress at arrival finishes; none starts after it.
        assert put_at is not None
        started_before = sum(1 for c in checks if c < put_at)
        assert p.reached_layer == started_before == during + 1, (p.reached_layer, started_before)
        queued = await serving.lookup(bus.redis, req.id)
        assert spans and queued is not None and queued.status is RequestStatus.QUEUED
        snap_key = keys.prefill_snapshot_key(RUN, req.id, p.reached_layer)
        # the state stays on this worker's snapshot shelf; Redis holds only its handle: "<dc> <holder>"
        holder = filler.port.prefill.snapshots.holder if filler.port.prefill.snapshots else None
        assert await bus.redis.get(snap_key) == f"{filler.port.prefill.dc} {holder}".encode()
        assert await filler.port.load_snapshot(snap_key, LAYERS) is not None

        # Bubble 2: resume where it stopped; the answer equals one uninterrupted prefill.
        rest = PrefillItem(
            id=req.id,
            tokens=PROMPT,
            from_layer=p.reached_layer,
            to_layer=LAYERS,
            reply_to=req.reply_to,
            snapshot_key=snap_key,
        )
        await one_bubble(filler, batch(rest, 2), arrive_during_block=None, model=model)
        second = (await reports(bus))[1]
        assert second.progress[0].outcome is ItemOutcome.DONE and not second.preempted
        # left for the dispatcher, which deletes it once it accepts the report (a stale copy of this
        # batch must not delete the state a live one resumes from)
        assert await bus.redis.exists(snap_key)
        found = await serving.lookup(bus.redis, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.status is RequestStatus.DONE and found.result is not None
        got = found.result
        assert (got.token, got.logprob) == (want.token, pytest.approx(want.logprob, abs=1e-6))
        stored = await kvstore.fetch_kv(bus.redis, req.id)
        assert stored is not None and stored.meta["format"] == kvstore.KV_FORMAT
        assert stored.prompt == list(PROMPT) and stored.first_token == want.token
        assert all(
            torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(stored.kv, want.kv, strict=True)
        )
        await filler.port.close_prefill()


async def test_a_snapshot_is_fetched_from_the_worker_holding_it_and_dropped_once_spent(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preempted prefill resumes on another worker: its state comes over TCP from the holder
    (its address is the handle in Redis); once the dispatcher deletes the handle (the resumed
    batch was reported) the holder drops the state; a holder that is gone leaves None."""
    torch.set_num_threads(1)
    monkeypatch.setattr(port_prefill, "SWEEP_S", 0.1)
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        holder, resumer = (StagePort(PrefillPort(bus.redis, RUN, kv_ttl_s=0)) for _ in range(2))
        state = model.start(list(PROMPT))
        model.run_layers(state, max_layers=3)
        assert await holder.save_snapshot("far", 3, state)
        key = keys.prefill_snapshot_key(RUN, "far", 3)
        assert len(await bus.redis.get(key)) < 64  # a handle, not the state
        await resumer.prefill.start()
        got = await resumer.load_snapshot(key, model.layers)
        assert got is not None and got.next_layer == 3 and torch.equal(got.hidden, state.hidden)
        assert holder.prefill.snapshots is not None and len(holder.prefill.snapshots.shelf.held) == 1
        await bus.redis.delete(key)  # spent: the dispatcher accepted the resumed batch's report
        holder.prefill._put_at[key] -= port_prefill.SWEEP_GRACE_S  # past the grace a fresh one gets
        await asyncio.wait_for(_until(lambda: not holder.prefill.snapshots.shelf.held), 15)  # type: ignore[union-attr]
        assert await resumer.load_snapshot(key, model.layers) is None  # no handle: gone
        assert await holder.save_snapshot("far", 4, state)
        await holder.close_prefill()  # the holder died: its snapshots with it (computed again from the prompt)
        assert await resumer.load_snapshot(keys.prefill_snapshot_key(RUN, "far", 4), model.layers) is LOST
        await resumer.close_prefill()


async def test_a_snapshot_held_in_another_datacenter_is_not_fetched(redis_url: str) -> None:
    """A worker of another DC does not fetch a snapshot over the WAN: it is told `ELSEWHERE` (and
    computes the request from its prompt) without opening a connection; a worker of the holder's
    DC fetches it."""
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        holder, near, far = (
            StagePort(PrefillPort(bus.redis, RUN, kv_ttl_s=0, dc=dc)) for dc in ("dc-a", "dc-a", "dc-b")
        )
        state = model.start(list(PROMPT))
        model.run_layers(state, max_layers=2)
        assert await holder.save_snapshot("abroad", 2, state)
        key = keys.prefill_snapshot_key(RUN, "abroad", 2)
        assert await far.load_snapshot(key, model.layers) is ELSEWHERE
        assert far.prefill.elsewhere == 1 and far.prefill._client.connects == 0
        got = await near.load_snapshot(key, model.layers)
        assert got is not None and got is not ELSEWHERE and got.next_layer == 2  # type: ignore[union-attr]
        assert near.prefill.elsewhere == 0 and near.prefill._client.connects == 1
        for p in (holder, near, far):
            await p.close_prefill()


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(200):  # a sweep on a timer: nothing to await but time
        if cond():
            return
        await asyncio.sleep(0.05)


async def test_a_batchs_first_block_runs_on_the_event_loop_and_the_rest_in_the_prefill_thread(
    redis_url: str,
) -> None:
    """The loop is on a core as the bubble opens; the prefill thread takes over after one block."""
    model = PrefillModel(GPTConfig(layers=4, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    loop_thread = threading.get_ident()
    ran_on: list[tuple[int, bool]] = []  # (layer, on the loop's thread)
    run_layers = model.run_layers

    def recording(state: PrefillState, *args: Any, **kw: Any) -> PrefillState:
        ran_on.append((state.next_layer, threading.get_ident() == loop_thread))
        return run_layers(state, *args, **kw)

    model.run_layers = recording  # type: ignore[method-assign]
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=4, reply_to="bt:test:results")
        await one_bubble(filler, batch(item, 1), arrive_during_block=None, model=model)
        (rep,) = await reports(bus)
    assert rep.progress[0].outcome is ItemOutcome.DONE
    assert ran_on == [(0, True), (1, False), (2, False), (3, False)]


async def test_a_batch_arriving_outside_a_bubble_goes_back_unrun(redis_url: str) -> None:
    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        await filler.on_batch(Delivery("1-0", "s", batch(item, 1), 1))  # no bubble open
        (rep,) = await reports(bus)
        (p,) = rep.progress
        assert p.reached_layer == 0 and p.outcome is ItemOutcome.PARTIAL and rep.preempted


async def test_a_staged_batch_no_bubble_takes_goes_back_after_the_hold(redis_url: str) -> None:
    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model, hold_s=0.05)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        t0 = time.monotonic()
        # held for the next bubble; none comes, so it goes back (the handler returns once reported)
        await asyncio.wait_for(filler.on_batch(Delivery("1-0", "s", batch(item, 1, hold=True), 1)), 60)
        assert time.monotonic() - t0 >= 0.05
        (rep,) = await reports(bus)
        assert rep.preempted and rep.progress[0].outcome is ItemOutcome.PARTIAL


async def test_a_batch_of_another_run_is_rejected(redis_url: str) -> None:
    model = PrefillModel(GPTConfig(layers=1, d_model=32, heads=4, seq_len=16, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model, run="other-run")
        item = PrefillItem(id="x", tokens=(1,), from_layer=0, to_layer=1, reply_to="bt:test:results")
        with pytest.raises(Reject, match="of run other-run"):
            await filler.on_batch(Delivery("1-0", "s", batch(item, 1), 1))


async def test_a_resumed_request_whose_holder_is_gone_is_computed_again_from_its_prompt(redis_url: str) -> None:
    torch.set_num_threads(1)
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = PrefillRequest(id="req-lost", model="m", tokens=PROMPT, submitted=time.time(), reply_to="bt:test:lost")
        assert await serving.accept(bus.redis, req, 100)
        holder = StagePort(PrefillPort(bus.redis, RUN, kv_ttl_s=0))
        state = model.start(list(PROMPT))
        model.run_layers(state, max_layers=5)
        assert await holder.save_snapshot(req.id, 5, state)
        await holder.close_prefill()  # its worker stopped: the handle is in Redis, the state is gone
        filler = filler_for(bus, model)
        rest = PrefillItem(
            id=req.id,
            tokens=PROMPT,
            from_layer=5,
            to_layer=LAYERS,
            reply_to=req.reply_to,
            snapshot_key=keys.prefill_snapshot_key(RUN, req.id, 5),
        )
        await one_bubble(filler, batch(rest, 7), arrive_during_block=None, model=model)
        found = await serving.lookup(bus.redis, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.status is RequestStatus.DONE and found.result is not None
        assert (found.result.token, found.result.logprob) == (want.token, pytest.approx(want.logprob, abs=1e-6))
