"""The prefill device profile on a real worker fill executor (real model, real Redis):

* a block that has started counts for its whole profiled time, even when training input arrives
  during it (preemption only at block boundaries, never by cutting a pad short);
* no block starts that would end after the bubble's predicted end minus the guard;
* real compute slower than the profile is counted as lag, never hidden;
* a batch lasts its profiled time: the thread's late wake-ups neither add up nor end its span.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.stage_worker.filler import Filler
from services.stage_worker.mailbox import Mailbox
from shared import serving
from shared.bus import Bus, Delivery
from shared.config import BusConfig
from shared.model.prefill import PrefillModel
from shared.model.shape import GPTConfig
from shared.policies.fill import FillPolicy
from shared.policies.prefill_cost import PrefillProfile
from shared.status import ItemOutcome
from shared.wire import PrefillBatch, PrefillItem, PrefillRequest
from tests.integration.test_fill_executor import reports

pytestmark = pytest.mark.integration

RUN = "fill"  # the reports helper reads this run's report stream
LAYERS = 8
MODEL = PrefillModel(GPTConfig(layers=LAYERS, d_model=32, heads=4, seq_len=64, vocab=256), seed=3)
PROMPT = tuple(range(1, 33))
GUARD_S = 0.002


async def bubble(
    bus: Bus,
    profile: PrefillProfile,
    *,
    predicted_s: float,
    input_after_s: float,
    spans: list[tuple[float, float]] | None = None,
) -> tuple[Filler, float, float]:
    """One bubble with one request queued; the input arrives `input_after_s` after it opened.
    Returns the filler, when the input arrived and when the fill gave training back (relative);
    the prefill spans it recorded go to `spans`."""
    req = PrefillRequest(id="q", model="m", tokens=PROMPT, submitted=time.time(), reply_to="bt:test:results")
    assert await serving.accept(bus.redis, req, 10)
    on_span = (lambda a, b: spans.append((a, b))) if spans is not None else (lambda a, b: None)
    filler = Filler(bus, RUN, "r0s0", MODEL, "m", 0, on_span, FillPolicy(guard_s=GUARD_S), profile)
    item = PrefillItem(id="q", tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
    mailbox, key = Mailbox(), ("grad", 0, 0)
    take = asyncio.ensure_future(mailbox.take(key))
    t0 = time.monotonic()
    fill = asyncio.create_task(filler.fill(lambda: mailbox.arrived(key), take, predicted_s, t0))
    handled = asyncio.create_task(
        filler.on_batch(Delivery("1-0", "s", PrefillBatch(run=RUN, worker="r0s0", batch_id="b", items=(item,)), 1))
    )
    await asyncio.sleep(input_after_s)  # the training input's arrival time is the test's input
    arrived = time.monotonic() - t0
    mailbox.put(key, torch.zeros(1))
    await asyncio.wait_for(fill, 10)
    resumed = time.monotonic() - t0
    await asyncio.wait_for(handled, 10)
    await take
    return filler, arrived, resumed


async def test_a_started_block_counts_for_its_whole_profiled_time(redis_url: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        # 60 ms a block, far above the real compute of this small model; input arrives 20 ms in
        _, arrived, resumed = await bubble(bus, PrefillProfile(0.060, 0.0), predicted_s=10.0, input_after_s=0.020)
        (rep,) = await reports(bus)
    (p,) = rep.progress
    assert p.outcome is ItemOutcome.PARTIAL and p.reached_layer == 1 and rep.preempted
    assert resumed >= 0.060 > arrived  # the pad was not cut short when the input came
    assert resumed < 0.060 + 0.050  # ... and training resumed at that block's boundary


async def test_no_block_starts_that_would_end_after_the_predicted_end(redis_url: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        # 10 ms blocks, a 39 ms bubble: its end minus the 2 ms guard is at 37 ms, so 3 blocks fit
        # (2 if the first starts over 7 ms late on a busy machine), never 4; the input comes later
        # than predicted, at 80 ms, and finds prefill long stopped
        _, _, resumed = await bubble(bus, PrefillProfile(0.010, 0.0), predicted_s=0.039, input_after_s=0.080)
        (rep,) = await reports(bus)
    (p,) = rep.progress
    assert p.reached_layer in (2, 3) and p.outcome is ItemOutcome.PARTIAL and rep.preempted
    assert resumed < 0.080 + 0.030  # no block was running when the input came


async def test_compute_slower_than_the_profile_is_counted_as_lag(redis_url: str) -> None:
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        # a profile claiming 1 microsecond a block: no CPU keeps up with that
        filler, _, _ = await bubble(bus, PrefillProfile(1e-6, 0.0), predicted_s=10.0, input_after_s=0.5)
        (rep,) = await reports(bus)
    assert rep.progress[0].outcome is ItemOutcome.DONE
    lag = filler.take_lag()
    assert lag > 0 and filler.take_lag() == 0.0  # taken once, then reset


async def test_a_batch_lasts_its_profiled_time_not_its_threads_wake_ups(redis_url: str) -> None:
    """8 blocks of 10 ms: the real compute of this small model takes a fraction of each, the
    thread sleeps out the rest, waking a little late each time. The blocks keep to one schedule
    (a late wake-up is won back by the next block's slack) and the span ends when the last block
    is due on the device: 80 ms, not 80 ms plus eight wake-ups (nor the host's last one)."""
    spans: list[tuple[float, float]] = []
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        filler, _, _ = await bubble(bus, PrefillProfile(0.010, 0.0), predicted_s=10.0, input_after_s=0.3, spans=spans)
        (rep,) = await reports(bus)
    assert rep.progress[0].outcome is ItemOutcome.DONE
    ((start, end),) = spans
    if filler.take_lag() == 0.0:  # the real work kept up (it may not on a machine stalled for 10 ms)
        assert end - start == pytest.approx(LAYERS * 0.010, abs=1e-6)
        assert rep.progress[0].seconds == pytest.approx(LAYERS * 0.010, abs=1e-3)
