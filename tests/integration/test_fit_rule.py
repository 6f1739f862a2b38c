"""One fit rule, in the live worker and the simulator alike (issue 63): on the same bubbles and
prompts, a real worker fill executor (real model, real Redis, a device profile's times) and the
simulator's executor run the same blocks and overrun the bubble by the same time (the live
worker's own lateness on a starved host, which it counts as lag, apart).

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

from services.stage_worker.fill.executor import Filler
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.stage_port import PrefillPort, StagePort
from services.stage_worker.port.tensors import Direction, TensorKey
from shared.bus import Bus, Delivery
from shared.config.spec import BusConfig
from shared.control import serving
from shared.model.prefill import PrefillModel
from shared.model.shape import GPTConfig
from shared.policies.decisions import Batch, BatchItem, Trigger, Why
from shared.policies.dispatch_inputs import Progress
from shared.policies.events import EventQueue
from shared.policies.fill import FillQueue
from shared.policies.prefill_cost import PrefillProfile
from shared.wire import PrefillBatch, PrefillItem, PrefillRequest
from sim.executor import Executor, SimRequest

RUN = "fit"
LAYERS = 8
MODEL = PrefillModel(GPTConfig(layers=LAYERS, d_model=32, heads=4, seq_len=64, vocab=256), seed=3)
PROMPT = tuple(range(1, 33))  # 32 tokens
#: the live worker's timing against the simulator's exact one, beyond the lateness the worker counts
#: itself (`BatchCompute.lag_s`): a loop's turn on a busy machine (each verdict below has 16 ms of
#: slack; a wrong rule differs by a whole block, 32-40 ms)
TOLERANCE_S = 0.010


@dataclass(frozen=True)
class Case:
    name: str
    profile: PrefillProfile
    predicted_s: float  # the bubble's predicted length (0: no prediction)
    input_s: float  # when training's input arrives, from the bubble's start


WHOLE = PrefillProfile(0.040, 0.0)  # a CPU's block: a whole layer, 40 ms
PIECES = PrefillProfile(0.016, 0.001, piece_tokens=16)  # a GPU's block: a piece of 16 tokens, 32 ms

CASES = [
    # blocks at 0, 40, 80 ms fit 156 ms (each needs 60 ms left); at 120 ms only 36 ms is left: its rest empty
    Case("layers, the prediction passed", WHOLE, 0.156, 0.200),
    # the input comes early, in the block started at 80 ms: training waits for its end at 120 ms
    Case("layers, the input early", WHOLE, 0.156, 0.100),
    # no prediction: only the input stops it (the block started at 80 ms runs to 120 ms)
    Case("layers, no prediction", WHOLE, 0.0, 0.100),
    # pieces of 32 ms, each needing 48 ms left of 128 ms: 0, 32, 64 ms start; at 96 ms 32 ms is left
    Case("pieces, the prediction passed", PIECES, 0.128, 0.180),
    # the input at 80 ms, in the piece started at 64 ms: training waits to 96 ms
    Case("pieces, the input early", PIECES, 0.128, 0.080),
]


@dataclass
class Seen:
    blocks: int  # the blocks the bubble ran
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
    p = ex.progress["b"]  # cut: still held, its progress kept
    start, end = host.spans[0][0], host.spans[-1][1]
    return Seen(p.layer * len(case.profile.pieces(len(PROMPT))) + p.piece, end - start, resumed - case.input_s)


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
    mailbox, key = Mailbox(), TensorKey(Direction.GRAD, 0, 0)
    loop = asyncio.get_running_loop()
    take = asyncio.ensure_future(mailbox.take(key))
    t0 = time.monotonic()
    arrival = loop.call_at(t0 + case.input_s, lambda: mailbox.put(key, torch.zeros(1)))
    ends_at = t0 + case.predicted_s if case.predicted_s > 0 else None
    await asyncio.wait_for(filler.fill(lambda: mailbox.arrived(key), take, ends_at), 30)
    resumed = time.monotonic() - t0
    await asyncio.wait_for(take, 30)
    arrival.cancel()
    lag = filler.compute.take_lag()  # how late its last block ended on a starved host, counted by the worker
    (o,) = filler.batches[batch.batch_id].queued.outcomes  # cut: still held, its state in memory
    assert o.state is not None
    blocks = o.state.next_layer * (len(PROMPT) // (piece or len(PROMPT))) + o.state.piece_done // (piece or len(PROMPT))
    await filler.close()  # the cut batch goes back, reported
    await asyncio.wait_for(handled, 30)
    await port.close_prefill()
    return Seen(blocks, spans[-1][1] - spans[0][0] - lag, max(0.0, resumed - case.input_s - lag))


#: Tries of a live case: a thread starved for tens of milliseconds by the suite's other worker (2
#: cores) checks the rule late, as a real worker on a starved host would; a wrong rule differs on
#: every try, by a whole block.
TRIES = 3


def close(got: Seen, want: Seen) -> bool:
    return (
        got.blocks == want.blocks
        and abs(got.span_s - want.span_s) <= TOLERANCE_S
        and abs(got.overrun_s - want.overrun_s) <= TOLERANCE_S
    )


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
    got = [(s.blocks, round(s.span_s, 6), round(s.overrun_s, 6)) for s in map(simulated, CASES)]
    assert got == [(3, 0.12, 0.0), (3, 0.12, 0.02), (3, 0.12, 0.02), (3, 0.096, 0.0), (3, 0.096, 0.016)]
