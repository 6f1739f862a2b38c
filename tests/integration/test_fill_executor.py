"""The worker's fill executor against a real Redis and a real prefill model.

Preemption: when training input arrives mid-prefill, at most the block already running finishes;
the batch stays queued on the worker with its state in memory, and its next bubble (here: a second
`fill`) continues it to exactly the answer of one uninterrupted prefill. A cut batch no bubble
takes in time goes back with its state snapshotted at the layer it reached, and a batch resuming
from that snapshot gives the same answer too.
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

from services.stage_worker.fill.announcer import BubbleAnnouncer
from services.stage_worker.fill.executor import Filler
from services.stage_worker.membership.lease import Slot
from services.stage_worker.port import prefill as port_prefill
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.outbox import Outbox
from services.stage_worker.port.stage_port import ELSEWHERE, LOST, PrefillPort, StagePort
from services.stage_worker.port.tensors import Direction, TensorKey
from services.stage_worker.telemetry import StageTelemetry
from shared.bus import Bus, Delivery, Reject
from shared.bus.connection import blocking_client
from shared.config.spec import BusConfig
from shared.control import serving
from shared.dataplane import kvstore
from shared.model.gpt import GPTConfig
from shared.model.prefill import PrefillModel, PrefillState
from shared.policies.bubbles import BubblePredictor
from shared.policies.fill import FillQueue
from shared.policies.prefill_cost import PrefillProfile
from shared.wire import PrefillBatch, PrefillItem, PrefillReport, PrefillRequest, decode, keys
from shared.wire.status import FailureReason, ItemOutcome, RequestStatus

RUN = "fill"
LAYERS = 24
CFG = GPTConfig(layers=LAYERS, d_model=64, heads=4, seq_len=256, vocab=256)
PROMPT = tuple(range(7, 7 + 200))


def batch(item: PrefillItem, n: int) -> PrefillBatch:
    return PrefillBatch(run=RUN, worker="r0s0", batch_id=f"b{n}", items=(item,))


def filler_for(bus: Bus, model: PrefillModel, *, run: str = RUN, kv_ttl_s: int = 0, **kw: Any) -> Filler:
    spans = kw.pop("on_span", lambda a, b: None)
    port = StagePort(PrefillPort(bus.redis, run, kv_ttl_s))
    return Filler(bus, run, "r0s0", model, "m", port, spans, FillQueue(**kw))


@contextlib.contextmanager
def arriving_during_block(
    model: PrefillModel, block: int, arrive: Callable[[], None], *, nth: bool = False, method: str = "run_layers"
) -> Iterator[None]:
    """Meanwhile `arrive()` runs on the event loop once block `block` of `model` has started (with
    `nth`: the `block`-th block run, counting from 0, whichever request it is), and the block waits
    for it: training input that lands while that block runs, however the host schedules the loop
    and the prefill thread (its arrival is the test's input, not a race). A batch's first block
    runs on the event loop itself: there the input lands directly."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    run_layers = getattr(model, method)  # or "run_piece": a piece of a layer is the block then
    calls = [0]

    def run_block(state: PrefillState, *args: Any, **kw: Any) -> PrefillState:
        hit = (calls[0] == block) if nth else (state.next_layer == block)
        calls[0] += 1
        if hit and threading.get_ident() == loop_thread:
            arrive()
        elif hit:
            landed = threading.Event()

            def land() -> None:
                arrive()
                landed.set()

            loop.call_soon_threadsafe(land)
            assert landed.wait(60), "the event loop never took the training input"
        return run_layers(state, *args, **kw)

    setattr(model, method, run_block)
    try:
        yield
    finally:
        delattr(model, method)  # the class's method again


async def one_bubble(
    filler: Filler,
    *,
    arrive_during_block: int | None,
    model: PrefillModel,
    finished: asyncio.Future[Any] | None = None,
    nth: bool = False,
    method: str = "run_layers",
) -> tuple[list[float], float | None, tuple[str, ...]]:
    """Run one bubble over what is queued on `filler`; training input arrives while block
    `arrive_during_block` of `model` runs (None: once `finished`, a batch's handler, is done:
    the batch answered and reported). Returns the times the batch checked for input (once before
    each block: the first in the event loop, the rest in the prefill thread), the arrival time,
    and the batches the bubble finished."""
    mailbox, key = Mailbox(), TensorKey(Direction.GRAD, 0, 0)
    checks: list[float] = []
    put_at: float | None = None

    def put() -> None:
        nonlocal put_at
        put_at = time.perf_counter()
        mailbox.put(key, torch.zeros(1))

    def arrived() -> bool:
        # a block's check (through the run's cut, `Filler._run`), not the fill loop's own between batches
        if sys._getframe(2).f_code.co_name == "_may_start":
            checks.append(time.perf_counter())
        return mailbox.arrived(key)

    with contextlib.ExitStack() as stack:
        if arrive_during_block is not None:
            stack.enter_context(arriving_during_block(model, arrive_during_block, put, nth=nth, method=method))
        take = asyncio.ensure_future(mailbox.take(key))
        # a long bubble: only the training input's arrival stops the prefill
        fill = asyncio.create_task(filler.fill(arrived, take))
        if arrive_during_block is None:
            assert finished is not None
            await asyncio.wait_for(asyncio.shield(finished), 60)  # done and reported (then acked)
            put()
        done = await asyncio.wait_for(fill, 60)
        await take
    return checks, put_at, done


async def accepted(bus: Bus, rid: str, reply_to: str = "bt:test:results") -> PrefillRequest:
    """A request of `PROMPT` accepted as the front door accepts it (counted in flight, queued)."""
    req = PrefillRequest(id=rid, model="m", tokens=PROMPT, submitted=time.time(), reply_to=reply_to)
    assert await serving.accept(bus.redis, RUN, req, 100)
    return req


def announcer_for(bus: Bus) -> tuple[Outbox, BubbleAnnouncer]:
    """Slot r0s0's outbox and bubble announcer, as a worker has them: where a bubble calls `fill`."""
    outbox = Outbox(bus)
    telemetry = StageTelemetry(outbox, RUN, 0, 0, "r0s0")
    return outbox, BubbleAnnouncer(outbox, RUN, Slot(0, 0), "dc-a", BubblePredictor(), 0, telemetry)


def deliver(filler: Filler, b: PrefillBatch) -> asyncio.Task[None]:
    """The fill stream's handler for `b`: it returns once the batch is answered and reported."""
    return asyncio.create_task(filler.on_batch(Delivery(f"{b.batch_id}-0", "s", b, 1)))


async def reports(bus: Bus) -> list[PrefillReport]:
    rows: Any = await bus.redis.xrange(keys.prefill_reports_stream(RUN))
    return [m for _, f in rows if isinstance(m := decode(f[b"m"]), PrefillReport)]


async def test_training_input_preempts_at_the_next_layer_and_the_next_bubble_goes_on_exactly(redis_url: str) -> None:
    torch.set_num_threads(1)
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = await accepted(bus, "req-1")
        spans: list[tuple[float, float]] = []
        filler = filler_for(bus, model, kv_ttl_s=60, on_span=lambda a, b: spans.append((a, b)))
        item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
        handled = deliver(filler, batch(item, 1))  # queued on the worker before its bubble opens

        # Bubble 1: the grad arrives while the prefill is running (in its ninth block of 24).
        during = LAYERS // 3
        checks, put_at, done = await one_bubble(filler, arrive_during_block=during, model=model)
        # The batch checks before each block: blocks started before the arrival = checks before
        # it. The block in progress at arrival finishes; none starts after it. The batch stays.
        assert put_at is not None and done == ()
        started_before = sum(1 for c in checks if c < put_at)
        (o,) = filler.batches["b1"].queued.outcomes
        assert o.reached == started_before == during + 1, (o.reached, started_before)
        assert filler.queue.ids() == ["b1"] and filler.queue.held[0].started and not handled.done()
        assert await reports(bus) == [] and spans
        queued = await serving.lookup(bus.redis, RUN, req.id)
        assert queued is not None and queued.status is RequestStatus.QUEUED

        # Bubble 2: it goes on where it stopped; the answer equals one uninterrupted prefill.
        _, _, done = await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        assert done == ("b1",)
        (rep,) = await reports(bus)
        assert rep.progress[0].outcome is ItemOutcome.DONE and rep.progress[0].reached_layer == LAYERS
        found = await serving.lookup(bus.redis, RUN, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.status is RequestStatus.DONE and found.result is not None
        got = found.result
        assert (got.token, got.logprob) == (want.token, pytest.approx(want.logprob, abs=1e-6))
        stored = await kvstore.fetch_kv(bus.redis, RUN, req.id)
        assert stored is not None and stored.meta["format"] == kvstore.KV_FORMAT
        assert stored.prompt == list(PROMPT) and stored.first_token == want.token
        assert all(
            torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(stored.kv, want.kv, strict=True)
        )
        await filler.port.close_prefill()


async def test_a_cancelled_fill_stops_its_thread_at_the_next_block_and_the_batch_goes_on_exactly(
    redis_url: str,
) -> None:
    """Recovery cancels a bubble's fill (a peer lost, issue 62): the prefill thread stops at the next
    block boundary before the cancellation returns (before, it computed on while the bubble's end
    handed the batch back, and a next bubble could run it a second time), the batch keeps its
    progress, and the next bubble finishes it to the answer of one uninterrupted prefill."""
    torch.set_num_threads(1)
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = await accepted(bus, "req-c")
        filler = filler_for(bus, model, kv_ttl_s=60)
        item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
        handled = deliver(filler, batch(item, 1))
        await asyncio.sleep(0)
        blocks: list[int] = []
        third = threading.Event()

        def counted(state: PrefillState, *args: Any, **kw: Any) -> PrefillState:
            blocks.append(state.next_layer)
            if len(blocks) == 3:  # in the prefill thread (the first block ran on the loop)
                third.set()
            return PrefillModel.run_layers(model, state, *args, **kw)

        model.run_layers = counted  # type: ignore[method-assign]
        mailbox, key = Mailbox(), TensorKey(Direction.GRAD, 0, 0)
        take = asyncio.ensure_future(mailbox.take(key))
        fill = asyncio.create_task(filler.fill(lambda: mailbox.arrived(key), take))
        assert await asyncio.to_thread(third.wait, 60)
        fill.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fill
        ran = len(blocks)
        # the prefill thread is idle: a call queued on it now runs before any further block would
        assert await asyncio.wrap_future(filler._thread.submit(lambda: len(blocks))) == ran < LAYERS
        (o,) = filler.batches["b1"].queued.outcomes
        assert o.reached == ran and filler.queue.ids() == ["b1"] and not handled.done()
        del model.run_layers
        take.cancel()
        _, _, done = await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        assert done == ("b1",)
        found = await serving.lookup(bus.redis, RUN, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.result is not None
        assert (found.result.token, found.result.logprob) == (want.token, pytest.approx(want.logprob, abs=1e-6))
        await filler.port.close_prefill()


async def test_a_cut_request_that_could_not_finish_by_its_due_time_when_it_resumes_fails_rather_than_answer_late(
    redis_url: str,
) -> None:
    """Predicted at 4 s and due in 5 s, a request begins (in time) and is cut by training input at
    its second layer; its next bubble comes 1.5 s later, when the 3.83 s left of it would end past
    its due time: failed there with `deadline`, not answered late (issue 50)."""
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = await accepted(bus, "req-cut")
        filler = filler_for(bus, model, hold_s=30.0)  # held on the worker between the two bubbles
        item = PrefillItem(
            id=req.id,
            tokens=PROMPT,
            from_layer=0,
            to_layer=LAYERS,
            reply_to=req.reply_to,
            predicted_ms=4000.0,
            due=time.time() + 5.0,
        )
        handled = deliver(filler, batch(item, 1))
        await one_bubble(filler, arrive_during_block=1, model=model)
        (o,) = filler.batches["b1"].queued.outcomes
        assert o.reached == 2 and o.failure is None  # begun in time, cut
        await asyncio.sleep(1.5)  # the next bubble opens 1.5 s later
        _, _, done = await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        assert done == ("b1",) and o.reached == 2  # nothing more ran
        found = await serving.lookup(bus.redis, RUN, req.id)
        assert found is not None and found.status is RequestStatus.FAILED and found.result is not None
        assert found.result.reason is FailureReason.DEADLINE and "cut by training input" in found.result.error
        (rep,) = await reports(bus)
        assert rep.progress[0].outcome is ItemOutcome.FAILED


async def test_a_cut_batch_no_bubble_takes_goes_back_snapshotted_and_resumes_exactly(redis_url: str) -> None:
    torch.set_num_threads(1)
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = await accepted(bus, "req-2")
        filler = filler_for(bus, model, hold_s=0.2)
        item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
        handled = deliver(filler, batch(item, 1))
        await one_bubble(filler, arrive_during_block=5, model=model)
        await asyncio.wait_for(handled, 60)  # no bubble within the hold: back, reported
        (first,) = await reports(bus)
        (p,) = first.progress
        assert first.preempted and p.outcome is ItemOutcome.PARTIAL and p.reached_layer == 6
        snap_key = keys.prefill_snapshot_key(RUN, req.id, p.reached_layer)
        # the state stays on this worker's snapshot shelf; Redis holds only its handle: "<dc> <holder>"
        holder = filler.port.prefill.snapshots.holder if filler.port.prefill.snapshots else None
        assert await bus.redis.get(snap_key) == f"{filler.port.prefill.dc} {holder}".encode()
        rest = PrefillItem(
            id=req.id, tokens=PROMPT, from_layer=6, to_layer=LAYERS, reply_to=req.reply_to, snapshot_key=snap_key
        )
        handled = deliver(filler, batch(rest, 2))
        await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        second = (await reports(bus))[1]
        assert second.progress[0].outcome is ItemOutcome.DONE and second.progress[0].started_layer == -1
        # left for the dispatcher, which deletes it once it accepts the report (a stale copy of this
        # batch must not delete the state a live one resumes from)
        assert await bus.redis.exists(snap_key)
        found = await serving.lookup(bus.redis, RUN, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.result is not None
        assert (found.result.token, found.result.logprob) == (want.token, pytest.approx(want.logprob, abs=1e-6))
        await filler.port.close_prefill()


SMALL = GPTConfig(layers=4, d_model=32, heads=4, seq_len=64, vocab=256)


async def two_requests_batched(
    bus: Bus, model: PrefillModel, name: str, reply_to: str = "bt:test:r", **fields: tuple[float, float]
) -> tuple[list[PrefillRequest], Filler, asyncio.Task[None]]:
    """Two three-token requests accepted as the front door accepts them (answers to `reply_to`, or
    to one stream each with "{}" in it), sent to a new worker as batch `b-{name}`, its items with
    these `fields` (a value for each): the requests, the worker and the batch's handler."""
    reqs = [
        PrefillRequest(id=f"{name}{i}", model="m", tokens=(1, 2, 3), submitted=time.time(), reply_to=reply_to.format(i))
        for i in range(2)
    ]
    for r in reqs:
        assert await serving.accept(bus.redis, RUN, r, 100)
    filler = filler_for(bus, model)
    items = tuple(
        PrefillItem(
            id=r.id,
            tokens=r.tokens,
            from_layer=0,
            to_layer=4,
            reply_to=r.reply_to,
            **{k: v[i] for k, v in fields.items()},
        )
        for i, r in enumerate(reqs)
    )
    return reqs, filler, deliver(filler, PrefillBatch(run=RUN, worker="r0s0", batch_id=f"b-{name}", items=items))


async def test_a_request_finished_in_a_cut_batch_is_answered_before_the_batch_ends(redis_url: str) -> None:
    model = PrefillModel(SMALL, seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        reqs, filler, handled = await two_requests_batched(bus, model, "q")
        await one_bubble(filler, arrive_during_block=5, model=model, nth=True)  # the second request's second block
        await asyncio.gather(*filler.batches["b-q"].answers.on_the_way)
        first, second = [await serving.lookup(bus.redis, RUN, r.id) for r in reqs]
        assert first is not None and first.status is RequestStatus.DONE
        assert second is not None and second.status is RequestStatus.QUEUED and not handled.done()
        _, _, done = await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        (rep,) = await reports(bus)
        assert done == ("b-q",) and [x.outcome for x in rep.progress] == [ItemOutcome.DONE, ItemOutcome.DONE]


async def test_an_answered_request_holds_no_tensors_while_its_batch_goes_on(redis_url: str) -> None:
    """Its KV cache leaves the device as it is answered (kept as bytes), not when the whole batch
    reports; the report still says it is done."""
    model = PrefillModel(SMALL, seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        _, filler, handled = await two_requests_batched(bus, model, "t")
        await one_bubble(filler, arrive_during_block=5, model=model, nth=True)  # the second request's second block
        await asyncio.gather(*filler.batches["b-t"].answers.on_the_way)
        first, second = filler.batches["b-t"].queued.outcomes
        assert first.sent and first.result is not None and first.result.kv == [] and first.state is None
        assert not second.answered and second.state is not None and not handled.done()  # cut: it goes on
        await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        (rep,) = await reports(bus)
        assert [x.outcome for x in rep.progress] == [ItemOutcome.DONE, ItemOutcome.DONE]


async def test_a_request_is_answered_as_soon_as_it_is_done_not_when_its_batch_is(redis_url: str) -> None:
    """The first request of a two-request batch is answered while the second still runs in the same
    bubble: the second's last block waits (in the prefill thread) for the first's answer to land in
    its reply stream, which never happened while answers went out at the run's end (issue 50: they
    came past the objective the worker had checked the first request against)."""
    model = PrefillModel(SMALL, seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        reqs, filler, handled = await two_requests_batched(bus, model, "e", reply_to="bt:test:e{}")
        first_landed = threading.Event()

        async def watch_first() -> None:
            reader = blocking_client(redis_url)
            try:
                assert await reader.xread({reqs[0].reply_to: "0"}, count=1, block=60_000), "no answer came"
                first_landed.set()
            finally:
                await reader.aclose()

        watcher = asyncio.create_task(watch_first())
        seen: list[bool] = []
        run_layers = model.run_layers
        calls = [0]

        def run_block(state: PrefillState, *args: Any, **kw: Any) -> PrefillState:
            calls[0] += 1
            if calls[0] == 8:  # the second request's last block, in the prefill thread
                seen.append(first_landed.wait(10))
            return run_layers(state, *args, **kw)

        model.run_layers = run_block  # type: ignore[method-assign]
        try:
            await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        finally:
            delattr(model, "run_layers")
        await watcher
        assert seen == [True], "the first request's answer waited for its batch"
        (rep,) = await reports(bus)
        assert [x.outcome for x in rep.progress] == [ItemOutcome.DONE, ItemOutcome.DONE]


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
    """The loop is on a core as the bubble opens; the prefill thread takes over after one block, and
    runs the bubble's later batches whole (the loop is left to send the first one's report)."""
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
        other = PrefillItem(id="y", tokens=(4, 5), from_layer=0, to_layer=4, reply_to="bt:test:results")
        deliver(filler, batch(item, 1))
        handled = deliver(filler, batch(other, 2))
        await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        reps = await reports(bus)
    assert [r.progress[0].outcome for r in reps] == [ItemOutcome.DONE, ItemOutcome.DONE]
    assert ran_on == [(0, True), (1, False), (2, False), (3, False)] + [(i, False) for i in range(4)]


async def test_a_batch_arriving_outside_a_bubble_waits_for_one_and_goes_back_after_the_hold(redis_url: str) -> None:
    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model, hold_s=0.05)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        t0 = time.monotonic()
        # queued for the worker's bubbles; none comes, so it goes back (the handler returns once reported)
        await asyncio.wait_for(filler.on_batch(Delivery("1-0", "s", batch(item, 1), 1)), 60)
        assert time.monotonic() - t0 >= 0.05
        (rep,) = await reports(bus)
        assert rep.preempted and rep.progress[0].outcome is ItemOutcome.PARTIAL and rep.progress[0].reached_layer == 0


async def test_a_redelivered_batch_and_one_arriving_as_the_worker_stops_go_straight_back(redis_url: str) -> None:
    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        await asyncio.wait_for(filler.on_batch(Delivery("1-0", "s", batch(item, 1), 2)), 60)  # delivered again
        queued = deliver(filler, batch(item, 2))
        await asyncio.sleep(0)
        await filler.close()  # hands back what is queued; what arrives from now on goes back at once
        await asyncio.wait_for(queued, 60)
        await asyncio.wait_for(filler.on_batch(Delivery("3-0", "s", batch(item, 3), 1)), 60)
        assert [r.batch_id for r in await reports(bus)] == ["b1", "b2", "b3"]
        assert all(r.preempted and r.progress[0].reached_layer == 0 for r in await reports(bus))


async def test_a_worker_told_to_leave_hands_back_what_it_holds_at_once_and_says_so(redis_url: str) -> None:
    """A drain: the worker trains on to its step boundary, but its queued prefill goes back to the
    dispatcher now (to workers that stay), a batch arriving meanwhile goes straight back, the
    dispatcher is told (`PrefillOff`), and its bubbles are not filled."""
    from shared.wire import PrefillOff

    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model, hold_s=600)  # the hold would keep it queued for ten minutes
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        queued = deliver(filler, batch(item, 1))
        await asyncio.sleep(0)
        assert filler.taking and [h.batch_id for h in filler.queue.held] == ["b1"]  # queued for a bubble
        filler.leave("slot r0s0 is leaving the run (drained)")
        await asyncio.wait_for(queued, 60)  # reported, not left for the hold
        await asyncio.wait_for(filler.on_batch(Delivery("2-0", "s", batch(item, 2), 1)), 60)
        assert [(r.batch_id, r.preempted) for r in await reports(bus)] == [("b1", True), ("b2", True)]
        assert not filler.taking
        await filler.close()  # its last writes done
        rows: Any = await bus.redis.xrange(keys.bubbles_stream(RUN))
        offs = [m for _, f in rows if isinstance(m := decode(f[b"m"]), PrefillOff)]
        assert [o.reason for o in offs] == ["slot r0s0 is leaving the run (drained)"]


async def test_a_batch_written_twice_runs_once_and_is_answered_and_reported_once(redis_url: str) -> None:
    """The dispatcher's flush is retried, so its XADD of a batch may apply twice (issue 62): the
    copy is acked and dropped, whether the first is still queued or already done; the first copy
    runs once, is answered and reported once, and its handler returns (before, the copy replaced
    the first's record: the first handler waited for ever, and the next bubble raised KeyError)."""
    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        first = asyncio.create_task(filler.on_batch(Delivery("1-0", "s", batch(item, 1), 1)))
        await asyncio.sleep(0)
        await asyncio.wait_for(filler.on_batch(Delivery("2-0", "s", batch(item, 1), 1)), 60)  # the copy
        assert [h.batch_id for h in filler.queue.held] == ["b1"]
        *_, done = await one_bubble(filler, arrive_during_block=None, model=model, finished=first)
        assert done == ("b1",)
        await asyncio.wait_for(filler.on_batch(Delivery("3-0", "s", batch(item, 1), 1)), 60)  # a late copy
        assert filler.queue.held == []
        assert [r.batch_id for r in await reports(bus)] == ["b1"]
        answers: Any = await bus.redis.xrange("bt:test:results")
        assert len(answers) == 1
        await filler.close()


async def test_a_fill_executor_that_fails_in_a_bubble_never_reaches_training(redis_url: str) -> None:
    """A bug of ours in the fill executor (here: its record of a queued batch gone) is fenced where
    the bubble calls it: the bubble's wait returns training's input, the worker hands back what it
    holds, takes no more prefill and tells the dispatcher."""
    from shared.wire import PrefillOff

    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        queued = deliver(filler, batch(item, 1))
        await asyncio.sleep(0)
        filler.batches.clear()  # the inconsistency a bug would leave: queued, but no record
        outbox, announcer = announcer_for(bus)
        awaited: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, awaited.set_result, "the activation")
        got = await asyncio.wait_for(announcer.wait(0, 0, 0, awaited, awaited.done, lambda: None, filler), 60)
        assert got == "the activation" and not filler.taking
        queued.cancel()  # its record was dropped by the "bug": nobody will finish its handler
        await asyncio.gather(queued, return_exceptions=True)
        await filler.close()
        await outbox.close()
        rows: Any = await bus.redis.xrange(keys.bubbles_stream(RUN))
        assert any(isinstance(decode(f[b"m"]), PrefillOff) for _, f in rows)


async def test_a_sticky_cuda_error_in_prefill_stops_the_worker_rather_than_train_on(redis_url: str) -> None:
    """An illegal memory access poisons the process's CUDA context: training on it would fail at its
    next call, or compute garbage. The fill executor raises it past its fence, out of the bubble's
    wait, so the worker stops and recovery replaces it (issue 62: it was caught as a RuntimeError, the
    request failed, and training carried on over a dead context). The request is failed, not lost."""
    from services.stage_worker.fill.guest_faults import DeviceLost

    model = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), seed=1)

    def poisoned(state: PrefillState, *args: Any, **kw: Any) -> PrefillState:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler = filler_for(bus, model)
        item = PrefillItem(id="x", tokens=(1, 2, 3), from_layer=0, to_layer=2, reply_to="bt:test:results")
        queued = deliver(filler, batch(item, 1))
        await asyncio.sleep(0)
        model.run_layers = poisoned  # type: ignore[method-assign]
        outbox, announcer = announcer_for(bus)
        awaited: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with pytest.raises(DeviceLost, match="sticky CUDA error"):
            await asyncio.wait_for(announcer.wait(0, 0, 0, awaited, awaited.done, lambda: None, filler), 60)
        await asyncio.wait_for(queued, 60)  # its request failed and reported, not lost
        answers: Any = await bus.redis.xrange("bt:test:results")
        assert len(answers) == 1
        await filler.close()
        await outbox.close()


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
        req = await accepted(bus, "req-lost", reply_to="bt:test:lost")
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
        handled = deliver(filler, batch(rest, 7))
        await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        (rep,) = await reports(bus)
        assert rep.progress[0].started_layer == 0  # computed again from its prompt
        found = await serving.lookup(bus.redis, RUN, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.status is RequestStatus.DONE and found.result is not None
        assert (found.result.token, found.result.logprob) == (want.token, pytest.approx(want.logprob, abs=1e-6))


async def test_a_layer_in_pieces_stops_within_a_piece_and_the_next_bubble_goes_on(redis_url: str) -> None:
    """With `piece_tokens`, training input arriving mid-layer stops the prefill after the piece
    running (not the whole layer); the next bubble goes on from that piece, to the answer of one
    uninterrupted prefill (up to float rounding: pieces are other matrix shapes)."""
    torch.set_num_threads(1)
    model = PrefillModel(CFG, seed=5)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = await accepted(bus, "req-p")
        filler = filler_for(bus, model)
        filler.compute.piece_tokens = 64  # 200 tokens: 4 pieces a layer
        item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
        handled = deliver(filler, batch(item, 1))
        # the input lands during the 10th piece: layer 2's second piece
        await one_bubble(filler, arrive_during_block=9, model=model, nth=True, method="run_piece")
        (o,) = filler.batches["b1"].queued.outcomes
        assert o.state is not None and (o.state.next_layer, o.state.piece_done) == (2, 128)
        assert o.reached == 2 and not handled.done()
        _, _, done = await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        assert done == ("b1",)
        found = await serving.lookup(bus.redis, RUN, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.result is not None
        assert found.result.token == want.token and found.result.logprob == pytest.approx(want.logprob, abs=1e-5)


async def test_a_piece_that_does_not_fit_what_is_left_of_the_bubble_waits_for_the_next(redis_url: str) -> None:
    """In pieces, a piece starts only if its time (here the device profile's) with a margin fits
    what is left of the bubble by its prediction: past a bubble's predicted end, a piece longer than
    the grace does not start, the bubble ends with the batch still queued (the fill loop does not
    spin until the input comes), and a later bubble with room runs it to the uninterrupted answer."""
    torch.set_num_threads(1)
    model = PrefillModel(CFG, seed=6)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = await accepted(bus, "req-f")
        filler = filler_for(bus, model)
        filler.compute.piece_tokens = 100  # 2 pieces a layer
        filler.compute.profile = PrefillProfile(fixed_s=0.0, per_token_s=10e-6)  # a piece: 1 ms on the device
        item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
        handled = deliver(filler, batch(item, 1))
        take = asyncio.get_running_loop().create_future()  # training input that never comes in this bubble
        await asyncio.sleep(0.05)  # the batch is queued
        done = await asyncio.wait_for(filler.fill(lambda: False, take, time.monotonic() + 0.001), 10)
        assert done == () and filler.queue.ids() == ["b1"]
        assert filler.full_at is not None  # its rest left empty: `BubbleEnd.refused_ms` counts from here
        (o,) = filler.batches["b1"].queued.outcomes
        assert o.state is not None and o.state.next_layer == 0 and not handled.done()
        fill = asyncio.create_task(filler.fill(take.done, take, time.monotonic() + 60))
        await asyncio.wait_for(asyncio.shield(handled), 60)  # answered and reported
        take.set_result(None)  # the input arrives: the bubble ends
        assert await asyncio.wait_for(fill, 10) == ("b1",) and filler.full_at is None
        found = await serving.lookup(bus.redis, RUN, req.id)
        want = model.prefill(list(PROMPT))
        assert found is not None and found.result is not None
        assert found.result.token == want.token and found.result.logprob == pytest.approx(want.logprob, abs=1e-5)


async def test_a_profiles_launch_floor_and_first_token_read_count_on_the_worker(redis_url: str) -> None:
    """With a device profile the worker counts its overheads as the simulator does
    (tests/unit/test_sim.py): every block at least `launch_s`, a finished request `sync_s` more."""
    model = PrefillModel(CFG, seed=7)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        req = await accepted(bus, "req-o")
        filler = filler_for(bus, model)
        filler.compute.profile = PrefillProfile(0.0, 0.0, launch_s=0.005, sync_s=0.1)  # 24 x 5 ms + 100 ms
        item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
        handled = deliver(filler, batch(item, 1))
        before = time.time()
        await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        [report] = await reports(bus)
        [progress] = report.progress
        assert progress.outcome is ItemOutcome.DONE
        assert progress.seconds >= LAYERS * 0.005 + 0.1 - 1e-3  # counted from the first block's start
        found = await serving.lookup(bus.redis, RUN, req.id)
        assert found is not None and found.result is not None  # answered once done on the device, not before
        assert found.result.finished >= before + LAYERS * 0.005 + 0.1 - 1e-3


async def two_items_in_one_bubble(redis_url: str, name: str, **fields: tuple[float, float]) -> tuple[list[Any], Any]:
    """Two three-token requests accepted as the front door accepts them, sent to a worker as one
    batch whose items have these `fields` (a value for each), run in one bubble: what each request's
    record says afterwards, and the batch's report."""
    model = PrefillModel(SMALL, seed=1)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        reqs, filler, handled = await two_requests_batched(bus, model, name, **fields)
        await one_bubble(filler, arrive_during_block=None, model=model, finished=handled)
        found = [await serving.lookup(bus.redis, RUN, r.id) for r in reqs]
        (rep,) = await reports(bus)
    return found, rep


async def test_an_item_the_worker_comes_to_past_its_due_time_fails_rather_than_answer_late(redis_url: str) -> None:
    """Work queued on a worker carries when its prompt is due (its objective or deadline): the one
    the worker reaches too late is failed with `deadline`, saying so; the next, not yet due, is
    answered. Never an answer past its objective (issue 50)."""
    now = time.time()
    (late, in_time), rep = await two_items_in_one_bubble(redis_url, "d", due=(now - 0.5, now + 600))
    assert late is not None and late.status is RequestStatus.FAILED and late.result is not None, late
    assert late.result.reason is FailureReason.DEADLINE and "after its prompt is due" in late.result.error
    assert in_time is not None and in_time.status is RequestStatus.DONE and in_time.result is not None
    assert [x.outcome for x in rep.progress] == [ItemOutcome.FAILED, ItemOutcome.DONE]


async def test_an_item_whose_prompt_may_have_moved_is_left_unrun_and_reported_not_started(redis_url: str) -> None:
    """A worker that comes, between bubbles, to an item the dispatcher may have moved to the decoder
    by then (`moves_from` passed) leaves it unrun: no answer from here (the decoder's is the one),
    reported not started at its first layer; the next item, not moved, is answered."""
    now = time.time()
    (moved, kept), rep = await two_items_in_one_bubble(redis_url, "m", moves_from=(now - 0.1, now + 600))
    assert moved is not None and moved.result is None, moved  # not answered here
    assert kept is not None and kept.status is RequestStatus.DONE and kept.result is not None
    assert [(x.outcome, x.reached_layer, x.seconds) for x in rep.progress] == [
        (ItemOutcome.PARTIAL, 0, 0.0),
        (ItemOutcome.DONE, 4, rep.progress[1].seconds),
    ]
