"""The prefill device profile on a real worker fill executor (real model, real Redis):

* a block that has started counts for its whole profiled time, even when training input arrives
  during it (preemption only at block boundaries, never by cutting a pad short);
* no block starts that would end after the bubble's predicted end minus the guard;
* real compute slower than the profile is counted as lag, never hidden;
* a batch lasts its profiled time: the thread's late wake-ups neither add up nor end its span.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from services.stage_worker.fill.executor import Filler
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.stage_port import PrefillPort, StagePort
from services.stage_worker.port.tensors import Direction, TensorKey
from shared.bus import Bus, Delivery
from shared.config.spec import BusConfig
from shared.control import serving
from shared.model.prefill import PrefillModel
from shared.model.shape import GPTConfig
from shared.policies.fill import FillQueue
from shared.policies.prefill_cost import PrefillProfile
from shared.wire import PrefillBatch, PrefillItem, PrefillRequest
from shared.wire.status import ItemOutcome
from tests.integration.test_fill_executor import arriving_during_block, reports

RUN = "fill"  # the reports helper reads this run's report stream
LAYERS = 8
MODEL = PrefillModel(GPTConfig(layers=LAYERS, d_model=32, heads=4, seq_len=64, vocab=256), seed=3)
PROMPT = tuple(range(1, 33))


async def bubble(
    bus: Bus,
    profile: PrefillProfile,
    *,
    input_during_block: int | None = None,
    spans: list[tuple[float, float]] | None = None,
) -> tuple[Filler, float]:
    """One bubble with one request queued; the training input arrives while block
    `input_during_block` runs (None: once the batch is done and reported, so prefill had stopped
    on its own; else the worker then stops, handing the cut batch back, reported). Returns the
    filler and when the fill gave training back (relative to the bubble's start); the prefill
    spans it recorded go to `spans`."""
    req = PrefillRequest(id="q", model="m", tokens=PROMPT, submitted=time.time(), reply_to="bt:test:results")
    assert await serving.accept(bus.redis, RUN, req, 10)
    on_span = (lambda a, b: spans.append((a, b))) if spans is not None else (lambda a, b: None)
    port = StagePort(PrefillPort(bus.redis, RUN, kv_ttl_s=0))
    filler = Filler(bus, RUN, "r0s0", MODEL, "m", port, on_span, FillQueue(), profile)
    item = PrefillItem(id="q", tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
    mailbox, key = Mailbox(), TensorKey(Direction.GRAD, 0, 0)

    def arrive() -> None:
        mailbox.put(key, torch.zeros(1))

    with contextlib.ExitStack() as stack:
        if input_during_block is not None:
            stack.enter_context(arriving_during_block(MODEL, input_during_block, arrive))
        take = asyncio.ensure_future(mailbox.take(key))
        t0 = time.monotonic()
        fill = asyncio.create_task(filler.fill(lambda: mailbox.arrived(key), take))
        handled = asyncio.create_task(
            filler.on_batch(Delivery("1-0", "s", PrefillBatch(run=RUN, worker="r0s0", batch_id="b", items=(item,)), 1))
        )
        if input_during_block is None:
            await asyncio.wait_for(handled, 60)  # answered or handed back, and reported
            arrive()
        await asyncio.wait_for(fill, 60)
        resumed = time.monotonic() - t0
        if input_during_block is not None:
            await filler.close()  # the cut batch goes back, reported
        await asyncio.wait_for(handled, 60)
        await take
    await port.close_prefill()  # a preempted request's snapshot was served from here
    return filler, resumed


def span_of(spans: list[tuple[float, float]]) -> float:
    ((start, end),) = spans
    return end - start


async def test_a_started_block_counts_for_its_whole_profiled_time(redis_url: str) -> None:
    spans: list[tuple[float, float]] = []
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        # 60 ms a block, far above the real compute of this small model; the input lands during
        # the first block
        filler, resumed = await bubble(bus, PrefillProfile(0.060, 0.0), input_during_block=0, spans=spans)
        (rep,) = await reports(bus)
    (p,) = rep.progress
    # training resumed at that block's boundary: it finished, and no block started after it
    assert p.outcome is ItemOutcome.PARTIAL and p.reached_layer == 1 and rep.preempted
    assert resumed >= 0.060  # the pad was not cut short when the input came
    # the batch lasted its one block on the device (longer only by compute that fell behind)
    assert span_of(spans) == pytest.approx(0.060 + filler.take_lag(), abs=1e-6)


async def test_compute_slower_than_the_profile_is_counted_as_lag(redis_url: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        # a profile claiming 1 microsecond a block: no CPU keeps up with that
        filler, _ = await bubble(bus, PrefillProfile(1e-6, 0.0))
        (rep,) = await reports(bus)
    assert rep.progress[0].outcome is ItemOutcome.DONE
    lag = filler.take_lag()
    assert lag > 0 and filler.take_lag() == 0.0  # taken once, then reset


async def test_a_batch_lasts_its_profiled_time_not_its_threads_wake_ups(redis_url: str) -> None:
    """8 blocks of 10 ms: the real compute of this small model takes a fraction of each, the
    thread sleeps out the rest, waking a little late each time. The blocks keep to one schedule
    (a late wake-up is won back by the next block's slack) and the span ends when the last block
    is due on the device: 80 ms, not 80 ms plus eight wake-ups (nor the host's last one). Only
    real work that fell behind the schedule (counted as lag: a machine stalled for 10 ms) makes
    it longer."""
    spans: list[tuple[float, float]] = []
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler, _ = await bubble(bus, PrefillProfile(0.010, 0.0), spans=spans)
        (rep,) = await reports(bus)
    assert rep.progress[0].outcome is ItemOutcome.DONE
    span = span_of(spans)
    assert span == pytest.approx(LAYERS * 0.010 + filler.take_lag(), abs=1e-6)
    assert 0 < rep.progress[0].seconds <= span + 1e-6  # the item's device time, within the batch's
