"""The analytic pipeline model: one training run's timeline on a virtual clock (pure).

Every worker (replica d, stage k) walks the same action list the live worker walks
(`shared.policies.schedules`). Forward/backward take the given compute times; a same-DC send
arrives at once; a cross-DC send is submitted to the `LinkSharing` of its directed link (the very
policy object the live `wan_broker` runs in WAN mode `model`) and arrives when that link says. On
links whose transfers the broker grants (`LinkModel.control`: modes `kernel`, `none`) it goes to
`SocketWan` instead: the slot protocol around the `SlotArbiter` the broker runs there, and the
bytes on the pair's connections (shared/policies/socket_wan.py). The gradient all-reduce
is a barrier of the stage's DP peers (inside one DC) plus its cost; the optimizer step takes its
cost. A receive whose input is not there yet is a **bubble** (worker, iteration, schedule
position, start, length).

It answers: iteration time, each worker's spans, bubbles and bubble fraction: the expected numbers
for benchmarks and the live workers' bubble predictions before they have history.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.policies.schedules import Action, Op, schedule
from shared.policies.socket_wan import SocketWan
from shared.policies.wan import LinkModel, LinkSharing, transfer_priority

Worker = tuple[int, int]  # (replica, stage)


@dataclass(frozen=True)
class PipelineInputs:
    stages: int
    dp: int
    microbatches: int
    schedule: str
    stage_dc: tuple[str, ...]
    fwd_s: tuple[float, ...]  # per stage, per microbatch
    bwd_s: tuple[float, ...]
    act_bytes: int  # activation (= gradient) bytes of one microbatch between stages
    links: dict[tuple[str, str], LinkModel]  # directed (src DC, dst DC) -> link
    sharing: str = "temporal"
    allreduce_s: tuple[float, ...] = ()  # per stage; empty = 0
    step_s: float = 0.0
    #: The step waits for every stage of its replica first (the pipeline's own collectives: the
    #: global gradient norm for clipping, a tied embedding's gradient): the stages that finish their
    #: backward passes first wait there, a bubble at the step's position, as on a live worker.
    step_barrier: bool = False


@dataclass(frozen=True)
class Span:
    replica: int
    stage: int
    iteration: int
    kind: str  # fwd, bwd, wait, allreduce, step
    start: float
    end: float
    mb: int = -1


@dataclass(frozen=True)
class Bubble:
    replica: int
    stage: int
    iteration: int
    position: int  # index of the blocking receive in the stage's action list
    start: float
    length: float


@dataclass
class PipelineResult:
    spans: list[Span]
    bubbles: list[Bubble]
    iteration_ends: list[float]  # when the last worker finished each iteration's step
    workers: int

    @property
    def makespan(self) -> float:
        return self.iteration_ends[-1]

    @property
    def iteration_times(self) -> list[float]:
        return [b - a for a, b in zip([0.0, *self.iteration_ends], self.iteration_ends, strict=False)]

    def bubble_fraction(self) -> float:
        """Share of worker time not spent computing (forward, backward, all-reduce, step)."""
        busy = sum(s.end - s.start for s in self.spans if s.kind != "wait")
        return 1 - busy / (self.workers * self.makespan) if self.makespan > 0 else 0.0

    def predicted_bubble(self, replica: int, stage: int, position: int) -> float:
        """Length of the bubble at a schedule position (0 if the model has none there), from the
        last simulated iteration (steady state)."""
        last = max((b.iteration for b in self.bubbles), default=0)
        for b in self.bubbles:
            if (b.replica, b.stage, b.position, b.iteration) == (replica, stage, position, last):
                return b.length
        return 0.0


@dataclass
class _State:
    actions: tuple[Action, ...]
    pos: int = 0
    iteration: int = 0
    blocked_since: float | None = None


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    run: Callable[[float], None] = field(compare=False)


_EPS = 1e-12


def simulate(inp: PipelineInputs, iterations: int = 1) -> PipelineResult:
    p, dp = inp.stages, inp.dp
    acts = {k: schedule(inp.schedule, k, p, inp.microbatches) for k in range(p)}
    states: dict[Worker, _State] = {(d, k): _State(acts[k]) for d in range(dp) for k in range(p)}
    links = {key: LinkSharing(model, inp.sharing) for key, model in inp.links.items() if model.control is None}
    granted = {key: model for key, model in inp.links.items() if model.control is not None}
    sockets = SocketWan(granted, inp.sharing)
    link_version = dict.fromkeys(links, 0)
    socket_version = [0]
    spans: list[Span] = []
    bubbles: list[Bubble] = []
    arrived: set[tuple[int, int, str, int, int]] = set()  # (replica, stage, kind, iteration, mb)
    in_flight: dict[str, tuple[int, int, str, int, int]] = {}  # transfer id -> receiver key
    barrier: dict[tuple[int, int], list[tuple[Worker, float]]] = {}
    at_step: dict[tuple[int, int], list[Worker]] = {}  # (replica, iteration) -> stages waiting to step
    released: set[tuple[int, int]] = set()  # (replica, iteration) whose stages have all reached the step
    ends: dict[int, float] = {}
    heap: list[_Event] = []
    seq = itertools.count()

    def at(t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(heap, _Event(t, next(seq), fn))

    def deliver(key: tuple[int, int, str, int, int], t: float) -> None:
        def arrive(now: float) -> None:
            arrived.add(key)
            w = (key[0], key[1])
            st = states[w]
            if st.blocked_since is not None and _waiting_for(w, st) == key:
                resume(w, now)

        at(t, arrive)

    def pump_link(lk: tuple[str, str], now: float) -> None:
        """Hand finished transfers to their receivers and book the link's next completion."""
        link = links[lk]
        for sent in link.advance(now):
            deliver(in_flight.pop(sent.id), sent.arrival)
        link_version[lk] += 1
        nxt = link.next_tx_end()
        if nxt is not None:
            version = link_version[lk]
            at(nxt, lambda t: pump_link(lk, t) if link_version[lk] == version else None)

    def pump_sockets(now: float) -> None:
        """The same for the granted links: their transfers and protocol steps, one clock."""
        for sent in sockets.advance(now):
            deliver(in_flight.pop(sent.id), sent.arrival)
        socket_version[0] += 1
        nxt = sockets.next_time()
        if nxt is not None:
            version = socket_version[0]
            at(nxt, lambda t: pump_sockets(t) if socket_version[0] == version else None)

    def send(w: Worker, a: Action, it: int, now: float) -> None:
        d, k = w
        dst = k + 1 if a.op is Op.SEND_ACT else k - 1
        kind = "act" if a.op is Op.SEND_ACT else "grad"
        key = (d, dst, kind, it, a.mb)
        src_dc, dst_dc = inp.stage_dc[k], inp.stage_dc[dst]
        if src_dc == dst_dc:
            deliver(key, now)
            return
        lk = (src_dc, dst_dc)
        tid = ":".join(map(str, key))
        in_flight[tid] = key
        priority = transfer_priority(it, a.mb, d)
        if lk in granted:  # the pair of workers: replica d's stages k and dst, both directions
            sockets.send(tid, lk, (d, min(k, dst)), inp.act_bytes, priority, now)
            pump_sockets(now)
            return
        links[lk].submit(tid, inp.act_bytes, priority, now)
        pump_link(lk, now)

    def finish_iteration(w: Worker, now: float) -> bool:
        st = states[w]
        ends[st.iteration] = max(ends.get(st.iteration, 0.0), now)
        st.iteration += 1
        st.pos = 0
        return st.iteration < iterations

    def resume(w: Worker, now: float) -> None:
        st = states[w]
        d, k = w
        if st.blocked_since is not None:
            if now - st.blocked_since > _EPS:
                spans.append(Span(d, k, st.iteration, "wait", st.blocked_since, now, st.actions[st.pos].mb))
                bubbles.append(Bubble(d, k, st.iteration, st.pos, st.blocked_since, now - st.blocked_since))
            st.blocked_since = None
        while True:
            if st.pos == len(st.actions) and not finish_iteration(w, now):
                return
            a, it = st.actions[st.pos], st.iteration
            if a.op in (Op.FWD, Op.BWD):
                dur = (inp.fwd_s if a.op is Op.FWD else inp.bwd_s)[k]
                spans.append(Span(d, k, it, a.op.value, now, now + dur, a.mb))
                st.pos += 1
                at(now + dur, functools.partial(resume, w))
                return
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                send(w, a, it, now)
                st.pos += 1
                continue
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                if _waiting_for(w, st) in arrived:
                    st.pos += 1
                    continue
                st.blocked_since = now
                return
            if a.op is Op.ALLREDUCE:
                group = barrier.setdefault((k, it), [])
                group.append((w, now))
                st.pos += 1
                if len(group) == dp:
                    last = max(t for _, t in group)
                    done = last + (inp.allreduce_s[k] if inp.allreduce_s else 0.0)
                    for peer, t0 in group:
                        if last - t0 > _EPS:  # waiting for slower peers is idle time
                            spans.append(Span(peer[0], k, it, "wait", t0, last))
                        if done - last > _EPS:
                            spans.append(Span(peer[0], k, it, "allreduce", last, done))
                        at(done, functools.partial(resume, peer))
                return
            if a.op is Op.STEP:
                if inp.step_barrier and p > 1 and (d, it) not in released:
                    waiting = at_step.setdefault((d, it), [])
                    waiting.append(w)
                    if len(waiting) < p:
                        st.blocked_since = now  # a bubble at the step's position, until the last stage comes
                        return
                    released.add((d, it))
                    for peer in at_step.pop((d, it))[:-1]:
                        at(now, functools.partial(resume, peer))
                st.pos += 1
                if inp.step_s > 0:
                    spans.append(Span(d, k, it, "step", now, now + inp.step_s))
                at(now + inp.step_s, functools.partial(resume, w))
                return

    for w in states:
        at(0.0, functools.partial(resume, w))
    while heap:
        ev = heapq.heappop(heap)
        ev.run(ev.time)
    if len(ends) != iterations:
        blocked = [f"{w}@{st.actions[st.pos]}" for w, st in states.items() if st.pos < len(st.actions)]
        raise RuntimeError(f"pipeline model deadlocked; blocked workers: {blocked}")
    return PipelineResult(spans, bubbles, [ends[i] for i in range(iterations)], workers=p * dp)


def _waiting_for(w: Worker, st: _State) -> tuple[int, int, str, int, int]:
    a = st.actions[st.pos]
    kind = "act" if a.op is Op.RECV_ACT else "grad"
    return (w[0], w[1], kind, st.iteration, a.mb)
