"""One fit rule, in the live worker and the simulator alike (issue 63): on the same bubbles and
prompts, a real worker fill executor (real model, real Redis, a device profile's times) and the
simulator's executor run the same blocks and overrun the bubble by the same time.

A block (a CPU's layer, or a piece of one) starts only while training's input has not arrived and
only if its time, with the margin, fits what is left of the bubble by its prediction
(`shared.policies.fill.may_start`). So a bubble predicted long enough is overrun only by the block
running when the input comes early, and one whose prediction is passed leaves its rest empty.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import torch

from services.stage_worker.filler import Filler
from services.stage_worker.mailbox import Mailbox
from services.stage_worker.port import PrefillPort, StagePort
from shared.bus import Bus, Delivery
from shared.control import serving
from shared.model.prefill import PrefillModel
from shared.model.shape import GPTConfig
from shared.policies.decisions import Batch, BatchItem, Trigger, Why
from shared.policies.dispatch import Progress
from shared.policies.events import EventQueue
from shared.policies.fill import FillQueue
from shared.policies.prefill_cost import PrefillProfile
from shared.spec.config import BusConfig
from shared.wire import PrefillBatch, PrefillItem, PrefillRequest
from sim.executor import Executor, SimRequest

RUN = "fit"
LAYERS = 8
MODEL = PrefillModel(GPTConfig(layers=LAYERS, d_model=32, heads=4, seq_len=64, vocab=256), seed=3)
PROMPT = tuple(range(1, 33))  # 32 tokens
#: the live worker's timing against the simulator's exact one: a thread's wake-up, a loop's turn on
#: a busy machine (a wrong rule differs by a whole block, 16-20 ms here; each verdict has 8 ms of slack)
TOLERANCE_S = 0.006


@dataclass(frozen=True)
class Case:
    name: str
    profile: PrefillProfile
    predicted_s: float  # the bubble's predicted length (0: no prediction)
    input_s: float  # when training's input arrives, from the bubble's start


WHOLE = PrefillProfile(0.020, 0.0)  # a CPU's block: a whole layer, 20 ms
PIECES = PrefillProfile(0.008, 0.0005, piece_tokens=16)  # a GPU's block: a piece of 16 tokens, 16 ms

CASES = [
    # blocks at 0, 20, 40 ms fit 78 ms (each needs 30 ms left); at 60 ms only 18 ms is left: its rest empty
    Case("layers, the prediction passed", WHOLE, 0.078, 0.110),
    # the input comes early, in the block started at 40 ms: training waits for its end at 60 ms
    Case("layers, the input early", WHOLE, 0.078, 0.050),
    # no prediction: only the input stops it (the block started at 40 ms runs to 60 ms)
    Case("layers, no prediction", WHOLE, 0.0, 0.050),
    # pieces of 16 ms, each needing 24 ms left of 64 ms: 0, 16, 32 ms start; at 48 ms 16 ms is left
    Case("pieces, the prediction passed", PIECES, 0.064, 0.100),
    # the input at 40 ms, in the piece started at 32 ms: training waits to 48 ms
    Case("pieces, the input early", PIECES, 0.064, 0.040),
]


@dataclass
class Seen:
    span_s: float  # the bubble's prefill: its first block's start to its last's end
    overrun_s: float  # training's wait past its input's arrival


def simulated(case: Case) -> Seen:
    class Host:
        spans: list[tuple[float, float]] = []

        def report(self, worker: int, batch: Batch, progress: list[Progress], now: float) -> None: ...

        def answered(self, requests: list[SimRequest], now: float) -> None: ...

        def late(self, requests: list[SimRequest], now: float) -> None: ...

        def prefill_span(self, worker: int, start: float, end: float, worked_s: float) -> None:
            self.spans.append((start, end))

    q, host = EventQueue(), Host()
    host.spans = []
    ex = Executor(0, LAYERS, FillQueue(), case.profile, q, host)
    item = BatchItem("q", SimRequest("q", len(PROMPT), 0.0), 0, LAYERS, case.profile.request_s(len(PROMPT), LAYERS))
    ex.on_batch(0.0, Batch("b", "r0s0", "r0s0", (item,), Why(Trigger.REQUEST, None, 0.0, 0.0, 0.0, 1)))
    ex.open(0.0, case.predicted_s or None)
    q.run(until=case.input_s)
    resumed = ex.input_arrived(case.input_s)
    ex.close(resumed)
    start, end = host.spans[0][0], host.spans[-1][1]
    return Seen(end - start, resumed - case.input_s)


async def live(bus: Bus, case: Case, attempt: int = 0) -> Seen:
    req = PrefillRequest(
        id=f"q-{case.name}-{attempt}", model="m", tokens=PROMPT, submitted=time.time(), reply_to="bt:test:fit"
    )
    assert await serving.accept(bus.redis, RUN, req, 10)
    spans: list[tuple[float, float]] = []
    port = StagePort(PrefillPort(bus.redis, RUN, kv_ttl_s=0))
    piece = case.profile.piece_tokens
    filler = Filler(
        bus,
        RUN,
        "r0s0",
        MODEL,
        "m",
        port,
        lambda a, b: spans.append((a, b)),
        FillQueue(),
        case.profile,
        piece_tokens=piece,
    )
    item = PrefillItem(id=req.id, tokens=PROMPT, from_layer=0, to_layer=LAYERS, reply_to=req.reply_to)
    batch = PrefillBatch(run=RUN, worker="r0s0", batch_id=f"b{attempt}", items=(item,))
    handled = asyncio.create_task(filler.on_batch(Delivery(f"{attempt + 1}-0", "s", batch, 1)))
    while not filler.queue.held:  # noqa: ASYNC110  # queued before its bubble opens (its credit): no event tells
        await asyncio.sleep(0.001)
    mailbox, key = Mailbox(), ("grad", 0, 0)
    loop = asyncio.get_running_loop()
    take = asyncio.ensure_future(mailbox.take(key))
    t0 = time.monotonic()
    arrival = loop.call_at(t0 + case.input_s, lambda: mailbox.put(key, torch.zeros(1)))
    ends_at = t0 + case.predicted_s if case.predicted_s > 0 else None
    await asyncio.wait_for(filler.fill(lambda: mailbox.arrived(key), take, ends_at), 30)
    resumed = time.monotonic() - t0
    await asyncio.wait_for(take, 30)
    arrival.cancel()
    await filler.close()  # the cut batch goes back, reported
    await asyncio.wait_for(handled, 30)
    await port.close_prefill()
    return Seen(spans[-1][1] - spans[0][0], max(0.0, resumed - case.input_s))


#: Tries of a live case: a thread starved for tens of milliseconds by the suite's other worker (2
#: cores) starts its blocks late, as a real worker on a starved host would; a wrong rule differs on
#: every try, by a whole block.
TRIES = 3


def close(got: Seen, want: Seen) -> bool:
    return abs(got.span_s - want.span_s) <= TOLERANCE_S and abs(got.overrun_s - want.overrun_s) <= TOLERANCE_S


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_the_live_worker_and_the_simulator_run_the_same_blocks_and_overrun_alike(
    redis_url: str, case: Case
) -> None:
    torch.set_num_threads(1)
    want = simulated(case)
    tries: list[Seen] = []
    async with Bus(redis_url, BusConfig(), name="test") as bus:
        while len(tries) < TRIES and not (tries and close(tries[-1], want)):
            tries.append(await live(bus, case, len(tries)))
    assert close(tries[-1], want), (want, tries)


def test_the_cases_are_what_their_comments_say() -> None:
    """The simulator's side alone, exactly: which blocks run and what training waits."""
    got = [(round(s.span_s, 6), round(s.overrun_s, 6)) for s in map(simulated, CASES)]
    assert got == [(0.060, 0.0), (0.060, 0.010), (0.060, 0.010), (0.048, 0.0), (0.048, 0.008)]
