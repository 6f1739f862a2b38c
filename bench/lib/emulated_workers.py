"""Emulated stage workers for bench/dispatcher.py: the dispatcher's side of a worker, no torch.

Each emulated worker holds its slot (the lease the readiness gate reads), reads its fill stream as
a real worker does (a consumer group, its own blocking connection), keeps the batches in a
`FillQueue` (the live worker's pure queue), and has a bubble of `bubble_s` every `period_s` (its
phase offset by its index). In a bubble it runs its queue as a device would, each request taking
`request_s` scaled by its prompt (no compute: it sleeps on the event loop), and announces the
bubble's start (with what it holds) and end (the batches that finished in it) on the run's bubble
stream. A finished batch is answered and reported in one pipelined round trip, as
`services/stage_worker/fill/reporting.py` does, then acked. What it measures: each request's wait from
its acceptance (`PrefillRequest.submitted`) to its batch arriving here (host clock), and the
requests it answered.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from shared.bus.connection import client_for
from shared.bus.streams import ensure_group
from shared.control import serving
from shared.policies.fill import FillQueue
from shared.wire import (
    FIELD,
    BubbleEnd,
    BubbleStart,
    PrefillBatch,
    PrefillProgress,
    PrefillReport,
    PrefillResult,
    decode,
    encode,
    keys,
)
from shared.wire.status import ItemOutcome, RequestStatus

#: The prompt length a request's `request_s` is for (it scales with the prompt, as a layer's matmuls do).
PROMPT_TOKENS = 96


@dataclass
class Shape:
    """The emulated pipeline: every worker's bubble, and what one request costs its device."""

    period_s: float  # an iteration
    bubble_s: float  # one bubble per iteration per worker
    request_s: float  # a PROMPT_TOKENS-token prompt's prefill


@dataclass
class Emulated:
    run: str
    replica: int
    stage: int
    dc: str
    shape: Shape
    index: int  # its phase in the iteration
    workers: int
    url: str
    fill_waits_s: list[float] = field(default_factory=list)
    answered: int = 0
    sent: int = 0  # messages to the dispatcher: bubble starts and ends, reports
    #: host clock (wall) of each bubble start and end announced, each report sent, and each read
    #: that brought batches (bench/control_plane.py counts them in its window)
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    reports: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    arrival_oldest: list[float] = field(default_factory=list)  # per arrival: its oldest request's acceptance
    _queue: FillQueue = field(default_factory=lambda: FillQueue(hold_s=3600.0))
    _batches: dict[str, tuple[str, PrefillBatch, float]] = field(default_factory=dict)  # id -> (entry, batch, left s)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _reporting: set[asyncio.Task[None]] = field(default_factory=set)
    #: the datacenter whose dispatcher reads its bubbles and reports (None: the run's one)
    dispatch_dc: str | None = None

    @property
    def name(self) -> str:
        return f"r{self.replica}s{self.stage}"

    async def run_until(self, stop: asyncio.Event) -> None:
        reader = client_for(self.url)
        writer = client_for(self.url)
        try:
            stream = keys.fill_stream(self.run, self.replica, self.stage, self.dispatch_dc)
            await ensure_group(writer, stream, "worker")
            tasks = [
                asyncio.create_task(self._read(reader, stream, stop)),
                asyncio.create_task(self._bubbles(writer, stop)),
            ]
            await stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, *self._reporting, return_exceptions=True)
        finally:
            await reader.aclose()
            await writer.aclose()

    async def _read(self, r: Redis, stream: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            reply: Any = await r.xreadgroup("worker", self.name, {stream: ">"}, count=256, block=200)
            now, oldest = time.time(), float("inf")
            for entry, fields in reply[0][1] if reply else []:
                b = decode(fields[FIELD])
                assert isinstance(b, PrefillBatch)
                self.fill_waits_s += [now - it.submitted for it in b.items]
                oldest = min([oldest, *(it.submitted for it in b.items)])
                left = sum(self._cost(len(it.tokens)) for it in b.items)
                self._batches[b.batch_id] = (entry.decode(), b, left)
                self._queue.arrive(b.batch_id, sum(it.predicted_ms for it in b.items) / 1000, time.monotonic())
            if reply:
                self.arrivals.append(now)
                self.arrival_oldest.append(oldest)
                self._arrived.set()

    def _cost(self, tokens: int) -> float:
        return self.shape.request_s * tokens / PROMPT_TOKENS

    async def _bubbles(self, r: Redis, stop: asyncio.Event) -> None:
        s, it = self.shape, 0
        origin = time.monotonic() + s.period_s * self.index / self.workers
        while not stop.is_set():
            start = origin + it * s.period_s
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            at = time.time()
            await self._send(
                r,
                BubbleStart(
                    run=self.run,
                    worker=self.name,
                    replica=self.replica,
                    stage=self.stage,
                    dc=self.dc,
                    iteration=it,
                    position=0,
                    predicted_ms=s.bubble_s * 1000,
                    free_memory_bytes=1 << 34,
                    at=at,
                    queued_ms=self._queue.queued_s * 1000,
                ),
            )
            self._queue.open()
            end = start + s.bubble_s
            while (now := time.monotonic()) < end:
                head = self._queue.head()
                if head is None:
                    self._arrived.clear()
                    try:
                        async with asyncio.timeout(end - now):
                            await self._arrived.wait()
                    except TimeoutError:
                        break
                    continue
                entry, batch, left = self._batches[head.batch_id]
                if now + left > end:  # the input comes first: it goes on in the next bubble
                    self._batches[head.batch_id] = (entry, batch, left - (end - now))
                    self._queue.ran(head.batch_id, finished=False, left_s=head.predicted_s)
                    await asyncio.sleep(end - now)
                    break
                await asyncio.sleep(left)
                self._queue.ran(head.batch_id, finished=True)
                del self._batches[head.batch_id]
                # off the path the next batch runs on, as the live worker reports
                task = asyncio.create_task(self._report(r, entry, batch))
                self._reporting.add(task)
                task.add_done_callback(self._reporting.discard)
            finished = self._queue.close()
            await self._send(
                r,
                BubbleEnd(
                    run=self.run,
                    worker=self.name,
                    replica=self.replica,
                    stage=self.stage,
                    iteration=it,
                    position=0,
                    predicted_ms=s.bubble_s * 1000,
                    actual_ms=s.bubble_s * 1000,
                    at=time.time(),
                    finished=finished,
                    queued_ms=self._queue.queued_s * 1000,
                ),
            )
            it += 1

    async def _send(self, r: Redis, msg: BubbleStart | BubbleEnd) -> None:
        (self.starts if isinstance(msg, BubbleStart) else self.ends).append(msg.at)
        await r.xadd(keys.bubbles_stream(self.run, self.dispatch_dc), {FIELD: encode(msg)})
        self.sent += 1

    async def _report(self, r: Redis, entry: str, batch: PrefillBatch) -> None:
        """Answer every request of `batch`, report it and ack it: one round trip (the ack in it)."""
        now = time.time()
        async with r.pipeline(transaction=False) as pipe:
            for it in batch.items:
                result = PrefillResult(
                    id=it.id,
                    status=RequestStatus.DONE,
                    token=1,
                    text="x",
                    logprob=-0.1,
                    prompt_tokens=len(it.tokens),
                    worker=self.name,
                    finished=now,
                )
                serving.queue_answer(pipe, self.run, result, it.reply_to, dc=self.dispatch_dc)
            progress = tuple(
                PrefillProgress(
                    id=it.id, outcome=ItemOutcome.DONE, reached_layer=it.to_layer, seconds=self._cost(len(it.tokens))
                )
                for it in batch.items
            )
            report = PrefillReport(
                run=self.run,
                worker=self.name,
                batch_id=batch.batch_id,
                progress=progress,
                preempted=False,
                at=time.time(),
            )
            pipe.xadd(keys.prefill_reports_stream(self.run, self.dispatch_dc), {FIELD: encode(report)})
            pipe.xack(keys.fill_stream(self.run, self.replica, self.stage, self.dispatch_dc), "worker", entry)
            await pipe.execute()
        self.answered += len(batch.items)
        self.sent += 1
        self.reports.append(time.time())


async def hold_slots(url: str, run: str, pp: int, dp: int, stop: asyncio.Event) -> None:
    """Every slot held (renewed each second) and every worker joined the run's generation: what the
    dispatcher's readiness gate reads to say training runs."""
    r = client_for(url)
    try:
        await r.set(keys.generation_key(run), 1)
        names = [f"r{d}s{k}" for d in range(dp) for k in range(pp)]
        await r.sadd(keys.generation_joined_key(run, 1), *names)
        while not stop.is_set():
            async with r.pipeline(transaction=False) as pipe:
                for d in range(dp):
                    for k in range(pp):
                        pipe.set(keys.lease_key(run, d, k), "bench", px=3000)
                await pipe.execute()
            try:
                async with asyncio.timeout(1.0):
                    await stop.wait()
            except TimeoutError:
                pass
    finally:
        await r.aclose()
