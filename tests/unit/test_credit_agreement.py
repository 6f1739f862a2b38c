"""What is queued on a worker and what the dispatcher believes is queued there agree at every moment.

Both sides are the pure policies the live system and the simulator run: the dispatcher's
`DispatchState` and each worker's `FillQueue`. Between them, messages travel as on Redis Streams:
each stream in order (a worker's fill stream; the run's bubble stream and report stream, which
interleave), each delivered after a random delay. Bubbles open and close at random, batches run to
their end or are cut by training input, work no bubble took goes back, requests arrive in bursts.

At every step, for every worker, the dispatcher's held batches are exactly: those on the worker's
queue, those still on their way to it, and those it has used or handed back of which no news (a
bubble end naming them, or a report: the first to arrive) has reached the dispatcher yet. Once
every message is delivered, the two sets are equal.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from shared.policies.decisions import Batch, Decisions
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import BubbleClosed, BubbleOpened, Progress, Request, WorkerReady
from shared.policies.fill import Arrival, FillQueue
from shared.policies.prefill_cost import PrefillCostModel

LAYERS = 4
WORKERS = ("w0", "w1", "w2")


@dataclass
class Worker:
    name: str
    queue: FillQueue
    batches: dict[str, Batch] = field(default_factory=dict)  # what is on its queue, by id
    tag: int = 0


@dataclass
class Wire:
    """Redis Streams as the test sees them: per stream a FIFO of (message, ids it carries news of)."""

    streams: dict[str, deque[tuple[object, tuple[str, ...]]]] = field(default_factory=dict)

    def send(self, stream: str, msg: object, news: tuple[str, ...] = ()) -> None:
        self.streams.setdefault(stream, deque()).append((msg, news))

    def heads(self) -> list[str]:
        return [s for s, q in self.streams.items() if q]

    def pop(self, stream: str) -> object:
        return self.streams[stream].popleft()[0]

    def to_worker(self, w: str) -> set[str]:
        return {m.batch_id for m, _ in self.streams.get(f"fill:{w}", ()) if isinstance(m, Batch)}

    def news_of(self, w: str) -> set[str]:
        """Batches of `w` whose use is on its way to the dispatcher (a bubble end or a report)."""
        out: set[str] = set()
        for _, news in self.streams.get(f"bubbles:{w}", ()):
            out.update(news)
        for msg, news in self.streams.get("reports", ()):
            if msg[1] == w:  # type: ignore[index]
                out.update(news)
        return out


class System:
    def __init__(self, rnd: random.Random) -> None:
        cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
        self.rnd = rnd
        self.state = DispatchState(layers=LAYERS, max_batch=3, cost=cost, hold_s=0.5)
        self.workers = {w: Worker(w, FillQueue(hold_s=0.5)) for w in WORKERS}
        self.wire = Wire()
        self.now, self.seq = 0.0, 0
        self.known_used: set[str] = set()  # batches whose use (or return) the dispatcher has heard of

    def execute(self, ds: Decisions) -> None:
        assert not ds.lost, "no worker dies here: nothing may be declared lost"
        for b in ds.batches:
            self.wire.send(f"fill:{b.worker}", b)

    # --- the workers' side -----------------------------------------------------------------

    def open(self, w: Worker) -> None:
        if w.queue.in_bubble:
            return
        w.queue.open()
        w.tag += 1
        msg = BubbleOpened(w.name, f"fill:{w.name}", self.rnd.uniform(0, 0.03), 10**9, self.now, w.tag)
        self.wire.send(f"bubbles:{w.name}", msg)

    def run(self, w: Worker) -> None:
        """The head batch runs to its end, or the input cuts it (and the bubble closes)."""
        head = w.queue.head()
        if head is None:
            return
        b = w.batches[head.batch_id]
        if self.rnd.random() < 0.7:
            w.queue.ran(b.batch_id, finished=True)
            del w.batches[b.batch_id]
            progress = [Progress(i.id, i.to_layer, i.seconds, True) for i in b.items]
            self.wire.send("reports", (b.batch_id, w.name, progress), (b.batch_id,))
        else:
            w.queue.ran(b.batch_id, finished=False, left_s=head.predicted_s / 2)
            self.close(w)

    def close(self, w: Worker) -> None:
        if not w.queue.in_bubble:
            return
        done = w.queue.close()
        self.wire.send(f"bubbles:{w.name}", BubbleClosed(w.name, w.tag, self.rnd.uniform(0, 0.05), done), done)

    def expire(self, w: Worker) -> None:
        for batch_id in w.queue.expired(self.now):
            b = w.batches.pop(batch_id)
            progress = [Progress(i.id, i.from_layer, 0.0) for i in b.items]  # back, unrun
            self.wire.send("reports", (batch_id, w.name, progress), (batch_id,))

    # --- delivery --------------------------------------------------------------------------

    def deliver(self, stream: str) -> None:
        msg = self.wire.pop(stream)
        s, now = self.state, self.now
        if isinstance(msg, Batch):
            w = self.workers[msg.worker]
            assert w.queue.arrive(msg.batch_id, msg.predicted_s, now) is Arrival.QUEUE
            w.batches[msg.batch_id] = msg
        elif isinstance(msg, BubbleOpened):
            self.execute(s.bubble_start(msg, now))
        elif isinstance(msg, BubbleClosed):
            self.known_used.update(msg.finished)
            self.execute(s.bubble_end(msg, now))
        else:
            batch_id, worker, progress = msg  # type: ignore[misc]
            self.known_used.add(batch_id)
            self.execute(s.report(batch_id, worker, progress, now))

    def requests(self) -> None:
        reqs = []
        for _ in range(self.rnd.choice((1, 1, 2, 5))):
            self.seq += 1
            tokens = self.rnd.choice((5, 10, 40))
            reqs.append(
                Request(
                    f"q{self.seq}", tokens, self.now, 100, deadline=self.now + self.rnd.uniform(0.05, 2), payload=None
                )
            )
        self.execute(self.state.add_requests(reqs, self.now))

    # --- the invariant ---------------------------------------------------------------------

    def check(self, *, quiet: bool = False) -> None:
        for w in self.workers.values():
            c = self.state.workers.get(w.name)
            believed = set(c.held) if c is not None else set()
            on_worker = set(w.queue.ids())
            assert on_worker == set(w.batches)
            if quiet:
                assert believed == on_worker, w.name
            else:
                news = self.wire.news_of(w.name) - self.known_used  # a batch's first news releases it
                assert believed == on_worker | self.wire.to_worker(w.name) | news, w.name


@pytest.mark.parametrize("seed", range(6))
def test_the_workers_queues_and_the_dispatchers_credit_agree(seed: int) -> None:
    rnd = random.Random(seed)
    sys = System(rnd)
    for w in WORKERS:  # the workers join: their first credit
        sys.execute(sys.state.worker_joined(WorkerReady(w, f"fill:{w}", rnd.uniform(0.01, 0.04), 10**9, 0.0), 0.0))
    used = 0
    for _ in range(3000):
        sys.now += rnd.uniform(0, 0.004)
        op = rnd.random()
        w = sys.workers[rnd.choice(WORKERS)]
        if op < 0.15:
            sys.requests()
        elif op < 0.25:
            sys.open(w)
        elif op < 0.45:
            sys.run(w)
        elif op < 0.55:
            sys.close(w)
        elif op < 0.6:
            sys.expire(w)
        elif op < 0.62:
            sys.execute(sys.state.tick(sys.now))
        elif sys.wire.heads():
            sys.deliver(rnd.choice(sys.wire.heads()))
        sys.check()
        used = sys.state.counts.done
    while sys.wire.heads():  # everything delivered: the two sides are equal
        sys.deliver(sys.wire.heads()[0])
    sys.check(quiet=True)
    assert used > 100 and sys.state.counts.batches > 100  # it did run
