"""A failing guest never stops the owner: the fill executor against a real Redis, with a prefill
model that really fails (services/stage_worker/chaos.py: a `RuntimeError`, or the device's
allocator refusing a petabyte).

A block that raises fails the request it ran (`prefill_error`, naming the exception), the items of
its batch not started go back to the dispatcher, and the bubble ends as any other; after
`guest.MAX_FAILURES` failed batches in a row the worker takes no more prefill: it hands back what
it holds and what arrives, says so on the bubbles stream (`PrefillOff`) and in its metrics.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from prometheus_client import generate_latest

from services.stage_worker import chaos
from services.stage_worker.fill.executor import Filler
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port.stage_port import PrefillPort, StagePort
from shared.bus import Bus, Delivery
from shared.config.spec import BusConfig
from shared.control import serving
from shared.model.gpt import GPTConfig
from shared.model.prefill import PrefillModel
from shared.policies.fill import FillQueue
from shared.policies.guest import MAX_FAILURES
from shared.wire import PrefillBatch, PrefillItem, PrefillOff, PrefillRequest, decode, keys
from shared.wire.status import FailureReason, ItemOutcome, RequestStatus
from tests.integration.test_fill_executor import RUN, deliver, one_bubble, reports

LAYERS = 4
NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is false (a CPU-only torch build, or no visible GPU)"
CFG = GPTConfig(layers=LAYERS, d_model=32, heads=4, seq_len=64, vocab=256)


def failing_model(setting: str) -> PrefillModel:
    return chaos.failing(PrefillModel(CFG, seed=1), setting)


async def accepted(bus: Bus, ids: list[str]) -> list[PrefillItem]:
    items = []
    for rid in ids:
        req = PrefillRequest(id=rid, model="m", tokens=(1, 2, 3), submitted=time.time(), reply_to="bt:test:r")
        assert await serving.accept(bus.redis, RUN, req, 100)
        items.append(PrefillItem(id=rid, tokens=req.tokens, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to))
    return items


def filler(bus: Bus, model: PrefillModel, metrics: WorkerMetrics | None = None) -> Filler:
    port = StagePort(PrefillPort(bus.redis, RUN, 0))
    return Filler(bus, RUN, "r0s0", model, "m", port, lambda a, b: None, FillQueue(), metrics=metrics)


async def test_a_block_that_raises_fails_its_request_hands_back_the_rest_and_the_bubble_ends(redis_url: str) -> None:
    model = failing_model("raise-after:5")  # the first request's 4 blocks run; the second's 2nd raises
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        f = filler(bus, model)
        items = await accepted(bus, ["ok", "bad", "later"])
        handled = deliver(f, PrefillBatch(run=RUN, worker="r0s0", batch_id="b1", items=tuple(items)))
        _, _, done = await one_bubble(f, arrive_during_block=None, model=model, finished=handled)
        assert done == ("b1",)  # done here: its credit comes back with the bubble's end
        (rep,) = await reports(bus)
        assert [(p.outcome, p.reached_layer) for p in rep.progress] == [
            (ItemOutcome.DONE, LAYERS),
            (ItemOutcome.FAILED, 1),
            (ItemOutcome.PARTIAL, 0),  # not started: the dispatcher queues it again
        ]
        ok, bad, later = [await serving.lookup(bus.redis, RUN, rid) for rid in ("ok", "bad", "later")]
        assert ok is not None and ok.status is RequestStatus.DONE
        assert bad is not None and bad.status is RequestStatus.FAILED and bad.result is not None
        assert bad.result.reason is FailureReason.PREFILL_ERROR
        assert "RuntimeError" in bad.result.error and "r0s0" in bad.result.error
        assert later is not None and later.status is RequestStatus.QUEUED
        assert f.guest.taking and f.guest.health.in_a_row == 1 and not f.batches


async def test_after_failed_batches_in_a_row_the_worker_takes_no_more_prefill(redis_url: str) -> None:
    model = failing_model("oom")  # every block: the allocator itself fails (CPU: RuntimeError; CUDA: OOM)
    metrics = WorkerMetrics(RUN, "r0s0", "m")
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        f = filler(bus, model, metrics)
        items = await accepted(bus, [f"q{i}" for i in range(MAX_FAILURES + 1)])
        handled = [
            deliver(f, PrefillBatch(run=RUN, worker="r0s0", batch_id=f"b{i}", items=(it,)))
            for i, it in enumerate(items)
        ]
        await asyncio.sleep(0.05)  # all queued before the bubble
        assert f.queue.ids() == [f"b{i}" for i in range(MAX_FAILURES + 1)]
        _, _, done = await one_bubble(f, arrive_during_block=None, model=model, finished=handled[MAX_FAILURES])
        assert done == tuple(f"b{i}" for i in range(MAX_FAILURES))  # each failed batch is done here
        await asyncio.wait_for(asyncio.gather(*handled), 60)
        assert not f.guest.taking and f.queue.ids() == [] and not f.batches
        # the last batch went back unstarted; one arriving now goes straight back
        await asyncio.wait_for(
            f.on_batch(
                Delivery("9-0", "s", PrefillBatch(run=RUN, worker="r0s0", batch_id="late", items=(items[0],)), 1)
            ),
            60,
        )
        by_batch = {r.batch_id: r for r in await reports(bus)}
        for i in range(MAX_FAILURES):
            (p,) = by_batch[f"b{i}"].progress
            assert p.outcome is ItemOutcome.FAILED
        for gone in (f"b{MAX_FAILURES}", "late"):
            (p,) = by_batch[gone].progress
            assert p.outcome is ItemOutcome.PARTIAL and p.reached_layer == 0
        failed = await serving.lookup(bus.redis, RUN, "q0")
        assert failed is not None and failed.result is not None and "can't allocate memory" in failed.result.error

        # the dispatcher is told, on the stream it reads bubble events from
        async def said_off() -> list[PrefillOff]:
            rows = await bus.redis.xrange(keys.bubbles_stream(RUN))
            return [m for _, fields in rows if isinstance(m := decode(fields[b"m"]), PrefillOff)]

        for _ in range(100):
            if offs := await said_off():
                break
            await asyncio.sleep(0.05)
        (off,) = offs
        assert off.worker == "r0s0" and f"{MAX_FAILURES} batches in a row" in off.reason
        # a bubble now runs nothing
        assert await f.fill(lambda: False, asyncio.get_running_loop().create_future()) == ()
        text = generate_latest(metrics.registry).decode()
        assert 'bubbletea:prefill_taking{model_name="m",run="fill",worker="r0s0"} 0.0' in text
        assert (
            f'bubbletea:prefill_batch_failures_total{{model_name="m",run="fill",worker="r0s0"}} {MAX_FAILURES}.0'
            in text
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
async def test_on_a_gpu_running_out_of_memory_fails_the_request_and_gives_the_memory_back(redis_url: str) -> None:
    """The likely failure on a GPU beside training: the device's allocator refuses (`oom`, a
    petabyte asked for), torch raises OutOfMemoryError, the request fails saying so, and what the
    failed run held on the device is given back."""
    dev = torch.device("cuda", 0)
    model = chaos.failing(PrefillModel(CFG, seed=1).place(dev), "oom-after:2")
    before = torch.cuda.memory_allocated(dev)
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        f = filler(bus, model)
        items = await accepted(bus, ["gpu-oom"])
        handled = deliver(f, PrefillBatch(run=RUN, worker="r0s0", batch_id="g1", items=tuple(items)))
        await one_bubble(f, arrive_during_block=None, model=model, finished=handled)
        found = await serving.lookup(bus.redis, RUN, "gpu-oom")
        assert found is not None and found.result is not None
        assert found.result.reason is FailureReason.PREFILL_ERROR and "OutOfMemoryError" in found.result.error
    assert torch.cuda.memory_allocated(dev) <= before  # nothing of the failed run is left on the GPU
