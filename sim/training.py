"""Training on the virtual clock: every (replica, stage) slot walks its schedule, as the live worker does.

The same mechanism as the analytic model (`shared.policies.pipeline_model`) and the live
`stage_worker`: the action lists of `shared.policies.schedules`, compute for its profiled time,
same-DC sends arriving at once, cross-DC sends through one `LinkSharing` per directed link (the
broker's policy object) ordered by `transfer_priority`, the all-reduce a barrier of the stage's DP
peers plus its cost. Two things the analytic model leaves out, as the live worker has them: every
tensor crosses the bus once (`bus_s`: same-DC sends to the peer's inbox, cross-DC ones from the
broker to the inbox, the last DP peer's gradients), and the wait at the all-reduce barrier is
inside the slot's `allreduce` span (no bubble is announced there). With no bus latency and that
one span merged, BubbleTea off reproduces the analytic model's timeline exactly
(tests/unit/test_sim_training.py).

What the model lacks and the live worker has, this adds: a receive whose input is not there is a
**bubble** announced with the worker's `BubblePredictor` (history per schedule position, the
analytic model's lengths as the prior); a `Guest` (the serving side) may fill it, and when the
input arrives training resumes when the guest says: at once, or at the end of the prefill block
already running (a started block runs to completion, which is how BubbleTea can slow training).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared.figures.runstats import Span
from shared.policies import pipeline_model
from shared.policies.bubbles import BubblePredictor
from shared.policies.pipeline_model import PipelineInputs
from shared.policies.schedules import Action, Op, schedule
from shared.policies.socket_wan import SocketWan
from shared.policies.wan import LinkSharing, transfer_priority
from sim.events import EventQueue
from sim.setup import BUS_S

#: A wait shorter than this is no wait (as in the analytic model).
EPS = 1e-12

Key = tuple[int, int, str, int, int]  # (replica, stage, "act" | "grad", iteration, microbatch)


class Guest(Protocol):
    """The serving side, as training sees it (`sim.serving.Serving`)."""

    def joined(self, worker: int, typical_s: float, now: float) -> None:
        """The worker entered the run (its typical predicted bubble): as a live worker's `WorkerJoined`."""
        ...

    def bubble_start(self, worker: int, iteration: int, position: int, predicted_s: float, now: float) -> None: ...

    def input_arrived(self, worker: int, now: float) -> float:
        """The awaited input is here: when training may resume (now, or when the running block ends)."""
        ...

    def bubble_end(self, worker: int, iteration: int, position: int, now: float) -> None: ...


@dataclass
class _Slot:
    replica: int
    stage: int
    actions: tuple[Action, ...]
    pos: int = 0
    iteration: int = 0
    blocked_since: float | None = None
    predicted_s: float = 0.0  # the announced length of the bubble it is in
    input_at: float = 0.0  # when the awaited input arrived (bubbles only)
    resuming: bool = False  # input arrived; training resumes when the running block ends


@dataclass
class TrainingResult:
    spans: list[Span]
    iteration_ends: list[float]  # when the last slot finished each iteration's step
    bubbles: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (worker, iteration, position) -> s
    inputs: PipelineInputs | None = None  # the analytic model's inputs, for the workers' priors

    @property
    def iteration_times(self) -> list[float]:
        return [b - a for a, b in zip([0.0, *self.iteration_ends], self.iteration_ends, strict=False)]

    def priors(self, workers: int, iteration: int = 1) -> list[dict[int, float]]:
        """Each slot's bubble lengths by schedule position in `iteration` of the analytic model (of
        this run when it has no `inputs`): a live worker's prior (`predict(spec, ..., iterations=2)`
        in services/stage_worker/worker.py). The model's, not this run's: the bus hops make this
        run's bubbles a little longer than the prior a live worker starts from."""
        out: list[dict[int, float]] = [{} for _ in range(workers)]
        if self.inputs is not None:
            model = pipeline_model.simulate(self.inputs, iteration + 1)
            stages = self.inputs.stages
            for b in model.bubbles:
                if b.iteration == iteration:
                    out[b.replica * stages + b.stage][b.position] = b.length
            return out
        for (w, it, pos), length in self.bubbles.items():
            if it == iteration:
                out[w][pos] = length
        return out


class Training:
    """One training run on `queue`. Slot `w` is (replica w // stages, stage w % stages)."""

    def __init__(
        self,
        inp: PipelineInputs,
        iterations: int,
        queue: EventQueue,
        *,
        guest: Guest | None = None,
        priors: list[dict[int, float]] | None = None,
        on_iteration: Callable[[int, float], None] | None = None,
        on_done: Callable[[float], None] | None = None,
        bus_s: float = BUS_S,
    ) -> None:
        p = inp.stages
        self.inp, self.iterations, self.q, self.guest = inp, iterations, queue, guest
        self.bus_s = bus_s
        acts = [schedule(inp.schedule, k, p, inp.microbatches) for k in range(p)]
        self.slots = [_Slot(d, k, acts[k]) for d in range(inp.dp) for k in range(p)]
        self.predictors = [BubblePredictor(dict(priors[w]) if priors else {}) for w in range(len(self.slots))]
        self.links = {key: LinkSharing(model, inp.sharing) for key, model in inp.links.items() if model.control is None}
        self._link_version = dict.fromkeys(self.links, 0)
        # links the broker grants (WAN modes kernel, none): the slot protocol and the sockets, as
        # the analytic model runs them; the receiver has a tensor when its last byte lands
        self.sockets = SocketWan({k: m for k, m in inp.links.items() if m.control is not None}, inp.sharing)
        self._socket_version = 0
        self._in_flight: dict[str, Key] = {}
        self._arrived: set[Key] = set()
        self._barrier: dict[tuple[int, int], list[tuple[int, float]]] = {}
        self._at_step: dict[tuple[int, int], list[int]] = {}  # (replica, iteration) -> slots waiting to step
        self._released: set[tuple[int, int]] = set()  # (replica, iteration) whose stages all reached the step
        self._ends: dict[int, float] = {}
        self._finished: dict[int, int] = {}  # iteration -> slots done with it
        self._left = len(self.slots)
        self._on_iteration, self._on_done = on_iteration, on_done
        self.spans: list[Span] = []
        self.bubbles: dict[tuple[int, int, int], float] = {}

    def start(self) -> None:
        for w in range(len(self.slots)):
            if self.guest is not None:
                self.guest.joined(w, self.predictors[w].typical(), 0.0)
            self.q.at(0.0, self._resume, w)

    def result(self) -> TrainingResult:
        if len(self._ends) != self.iterations:
            blocked = [f"r{s.replica}s{s.stage}@{s.actions[s.pos]}" for s in self.slots if s.pos < len(s.actions)]
            raise RuntimeError(f"the simulated pipeline deadlocked; blocked slots: {blocked[:8]}")
        return TrainingResult(self.spans, [self._ends[i] for i in range(self.iterations)], self.bubbles, self.inp)

    # --- tensors ---------------------------------------------------------------------------

    def _arrive(self, now: float, key: Key) -> None:
        self._arrived.add(key)
        w = key[0] * self.inp.stages + key[1]
        st = self.slots[w]
        if st.blocked_since is None or st.resuming or self._waiting_for(st) != key:
            return
        self._input_here(now, w)

    def _input_here(self, now: float, w: int) -> None:
        """What blocked slot `w` waited for is here (a tensor, or the last stage at the step):
        training resumes now, or, with BubbleTea, once the running prefill block ends."""
        st = self.slots[w]
        if self.guest is None:
            self._resume(now, w)
            return
        st.input_at = now
        at = self.guest.input_arrived(w, now)
        if at > now:
            st.resuming = True
            self.q.at(at, self._resume, w)
        else:
            self._resume(now, w)

    def _pump(self, now: float, lk: tuple[str, str]) -> None:
        """Hand finished transfers to their receivers and book the link's next completion."""
        link = self.links[lk]
        for sent in link.advance(now):  # the broker delivers at the arrival: one hop to the inbox
            self.q.at(sent.arrival + self.bus_s, self._arrive, self._in_flight.pop(sent.id))
        self._link_version[lk] += 1
        nxt = link.next_tx_end()
        if nxt is not None:
            self.q.at(nxt, self._pump_if_current, (lk, self._link_version[lk]))

    def _pump_if_current(self, now: float, arg: tuple[tuple[str, str], int]) -> None:
        lk, version = arg
        if self._link_version[lk] == version:
            self._pump(now, lk)

    def _pump_sockets(self, now: float, version: int | None = None) -> None:
        """The same for the granted links (`version`: only if nothing changed since it was booked)."""
        if version is not None and version != self._socket_version:
            return
        for sent in self.sockets.advance(now):
            self.q.at(sent.arrival, self._arrive, self._in_flight.pop(sent.id))
        self._socket_version += 1
        nxt = self.sockets.next_time()
        if nxt is not None:
            self.q.at(nxt, self._pump_sockets, self._socket_version)

    def _send(self, st: _Slot, a: Action, now: float) -> None:
        d, k, it = st.replica, st.stage, st.iteration
        act = a.op is Op.SEND_ACT
        dst = k + 1 if act else k - 1
        key: Key = (d, dst, "act" if act else "grad", it, a.mb)
        src_dc, dst_dc = self.inp.stage_dc[k], self.inp.stage_dc[dst]
        if src_dc == dst_dc:  # straight to the peer's inbox: one hop
            self.q.at(now + self.bus_s, self._arrive, key)
            return
        lk = (src_dc, dst_dc)
        tid = f"{d}:{dst}:{key[2]}:{it}:{a.mb}"
        self._in_flight[tid] = key
        if lk in self.sockets.links:  # the pair of workers: replica d's stages k and dst
            self.sockets.send(tid, lk, (d, min(k, dst)), self.inp.act_bytes, transfer_priority(it, a.mb, d), now)
            self._pump_sockets(now)
            return
        self.links[lk].submit(tid, self.inp.act_bytes, transfer_priority(it, a.mb, d), now)
        self._pump(now, lk)

    # --- the schedule walk -----------------------------------------------------------------

    def _resume(self, now: float, w: int) -> None:
        st = self.slots[w]
        d, k = st.replica, st.stage
        if st.blocked_since is not None:
            self._end_wait(st, w, now)
        inp, spans = self.inp, self.spans
        while True:
            if st.pos == len(st.actions) and not self._finish_iteration(st, now):
                return
            a, it = st.actions[st.pos], st.iteration
            op = a.op
            if op is Op.FWD or op is Op.BWD:
                dur = (inp.fwd_s if op is Op.FWD else inp.bwd_s)[k]
                spans.append(Span(d, k, it, op.value, now, now + dur, a.mb))
                st.pos += 1
                self.q.at(now + dur, self._resume, w)
                return
            if op is Op.SEND_ACT or op is Op.SEND_GRAD:
                self._send(st, a, now)
                st.pos += 1
                continue
            if op is Op.RECV_ACT or op is Op.RECV_GRAD:
                if self._waiting_for(st) in self._arrived:
                    self._arrived.discard(self._waiting_for(st))
                    st.pos += 1
                    continue
                st.blocked_since = now
                if self.guest is not None:
                    st.predicted_s = self.predictors[w].predict(st.pos)
                    self.guest.bubble_start(w, it, st.pos, st.predicted_s, now)
                return
            if op is Op.ALLREDUCE:
                self._allreduce(st, w, now)
                return
            if op is Op.STEP:
                barrier = inp.step_barrier and inp.stages > 1 and (d, it) not in self._released
                if barrier and self._wait_at_step(st, w, now):
                    return
                st.pos += 1
                if inp.step_s > 0:
                    spans.append(Span(d, k, it, "step", now, now + inp.step_s))
                self.q.at(now + inp.step_s, self._resume, w)
                return

    def _wait_at_step(self, st: _Slot, w: int, now: float) -> bool:
        """The step's barrier across the replica's stages (the live step's collectives): True if
        slot `w` waits there (a bubble at the step's position, announced like a receive's); the
        last stage to come releases the others, their collective a bus hop later."""
        d, it = st.replica, st.iteration
        waiting = self._at_step.setdefault((d, it), [])
        waiting.append(w)
        if len(waiting) < self.inp.stages:
            st.blocked_since = now
            if self.guest is not None:
                st.predicted_s = self.predictors[w].predict(st.pos)
                self.guest.bubble_start(w, it, st.pos, st.predicted_s, now)
            return True
        self._released.add((d, it))
        for peer in self._at_step.pop((d, it))[:-1]:
            self.q.at(now + self.bus_s, self._input_here, peer)
        return False

    def _end_wait(self, st: _Slot, w: int, now: float) -> None:
        """The bubble of slot `w` is over (its input came, and any running prefill block ended)."""
        assert st.blocked_since is not None
        it, pos, length = st.iteration, st.pos, now - st.blocked_since
        if length > EPS:
            mb = st.actions[pos].mb
            if self.guest is None:
                self.spans.append(Span(st.replica, st.stage, it, "wait", st.blocked_since, now, mb))
            else:
                predicted_ms = st.predicted_s * 1000
                self.spans.append(
                    Span(st.replica, st.stage, it, "wait", st.blocked_since, now, mb, predicted_ms, st.input_at)
                )
            self.bubbles[(w, it, pos)] = length
        if self.guest is not None:
            self.predictors[w].observe(pos, st.predicted_s, length, it)
            self.guest.bubble_end(w, it, pos, now)
        st.blocked_since, st.resuming = None, False
        if st.actions[pos].op is not Op.STEP:  # a receive is consumed; the step runs next, released
            self._arrived.discard(self._waiting_for(st))
            st.pos += 1

    def _allreduce(self, st: _Slot, w: int, now: float) -> None:
        """A barrier of the stage's DP peers, then the cost, ending for all at one instant. As on a
        live worker, one `allreduce` span runs from the slot's arrival to that end: waiting there
        for a slower peer is part of the collective (no bubble is announced), not a `wait`. The
        last peer's gradients cross the bus to the others (one hop) before they can be summed."""
        k, it = st.stage, st.iteration
        group = self._barrier.setdefault((k, it), [])
        group.append((w, now))
        st.pos += 1
        if len(group) < self.inp.dp:
            return
        del self._barrier[(k, it)]
        last = max(t for _, t in group)
        cost = self.inp.allreduce_s[k] if self.inp.allreduce_s else 0.0
        done = last + (max(cost, self.bus_s) if self.inp.dp > 1 else cost)
        for peer, t0 in group:
            if done - t0 > EPS:
                self.spans.append(Span(self.slots[peer].replica, k, it, "allreduce", t0, done))
            self.q.at(done, self._resume, peer)

    def _finish_iteration(self, st: _Slot, now: float) -> bool:
        it = st.iteration
        self._ends[it] = max(self._ends.get(it, 0.0), now)
        self._finished[it] = self._finished.get(it, 0) + 1
        if self._finished[it] == len(self.slots) and self._on_iteration is not None:
            self._on_iteration(it, now)
        st.iteration += 1
        st.pos = 0
        if st.iteration < self.iterations:
            return True
        self._left -= 1
        if self._left == 0 and self._on_done is not None:
            self._on_done(now)
        return False

    def _waiting_for(self, st: _Slot) -> Key:
        a = st.actions[st.pos]
        return (st.replica, st.stage, "act" if a.op is Op.RECV_ACT else "grad", st.iteration, a.mb)
