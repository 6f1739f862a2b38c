"""A training run on a virtual clock (pure): every slot drives its `SlotWalk`; the analytic model and
the simulator are this one engine.

The clock is an `EventQueue`; the effects are the ones a live run has, as durations and policy
objects:

* forward, backward and the step take their profiled times (`PipelineInputs`);
* a same-DC send reaches the peer's inbox one bus hop later (`bus_s`);
* a cross-DC send is submitted to the `LinkSharing` of its directed link (the policy object the
  live `wan_broker` runs in WAN mode `model`), ordered by `transfer_priority`, and lands a bus hop
  after its arrival; on links the broker grants (`LinkModel.control`: modes `kernel`, `none`) it
  goes to `SocketWan` instead (the slot protocol around the `SlotArbiter`, and the bytes on the
  pair's connections) and lands with its last byte;
* the DP all-reduce is a barrier of the stage's peers plus its cost; as on a live worker, one
  `allreduce` span runs from a slot's arrival to the collective's end (no bubble is announced there);
* the pipeline's cross-stage collectives before the step (`PipelineInputs.step_collectives`) are
  a barrier of the replica's stages: those that come first wait there, a bubble at the step's
  position, released a bus hop after the last stage comes.

A receive whose input is not there is a **bubble** (a `wait` span). With a `Guest` (the serving
side, `sim.serving.Serving`) each bubble is announced with the slot's `BubblePredictor` (history
per schedule position, the analytic model's lengths as the prior); when the input arrives,
training resumes when the guest says: at once, or when the prefill block already running ends (a
started block runs to completion, which is how BubbleTea can slow training).

The analytic model (`simulate`, below) is this engine with no guest and no bus hops.

Tested by: tests/unit/test_pipeline_model.py, tests/unit/test_sim_training.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from shared.policies.bubbles import BubblePredictor
from shared.policies.events import EventQueue
from shared.policies.pipeline_model import Bubble, PipelineInputs, PipelineResult
from shared.policies.schedules import Op, schedule
from shared.policies.socket_wan import SocketWan
from shared.policies.spans import Span
from shared.policies.walk import COLLECTIVES, Key, Phase, SlotWalk
from shared.policies.wan import LinkSharing, transfer_priority

#: A wait shorter than this is no wait.
EPS = 1e-12


class Guest(Protocol):
    """The serving side, as training sees it (`sim.serving.Serving`)."""

    def joined(self, worker: int, typical_s: float, now: float) -> None:
        """The worker entered the run (its typical predicted bubble): as a live worker's `WorkerJoined`."""
        ...

    def bubble_start(
        self, worker: int, iteration: int, position: int, predicted_s: float, now: float, room_s: float | None = None
    ) -> None:
        """A bubble opened, predicted to last `predicted_s`; the fit rule takes it to last `room_s`
        (`BubblePredictor.room`; None: nothing known)."""
        ...

    def input_arrived(self, worker: int, now: float) -> float:
        """The awaited input is here: when training may resume (now, or when the running block ends)."""
        ...

    def bubble_end(self, worker: int, iteration: int, position: int, now: float) -> None: ...


class _Slot:
    """A slot's walk and what its driver keeps beside it while it is blocked."""

    __slots__ = ("blocked_since", "input_at", "predicted_s", "resuming", "walk")

    def __init__(self, walk: SlotWalk) -> None:
        self.walk = walk
        self.blocked_since: float | None = None
        self.predicted_s = 0.0  # the announced length of the bubble it is in
        self.input_at = 0.0  # when the awaited input arrived (bubbles only)
        self.resuming = False  # input arrived; training resumes when the running block ends


class PipelineRun:
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
        bus_s: float = 0.0,
    ) -> None:
        p = inp.stages
        self.inp, self.iterations, self.q, self.guest = inp, iterations, queue, guest
        self.bus_s = bus_s
        acts = [schedule(inp.schedule, k, p, inp.microbatches) for k in range(p)]
        collect = inp.step_collectives and p > 1
        self.slots = [
            _Slot(SlotWalk(d, k, acts[k], iterations=iterations, collectives=collect))
            for d in range(inp.dp)
            for k in range(p)
        ]
        self.predictors = [BubblePredictor(dict(priors[w]) if priors else {}) for w in range(len(self.slots))]
        self.links = {key: LinkSharing(model, inp.sharing) for key, model in inp.links.items() if model.control is None}
        self._link_version = dict.fromkeys(self.links, 0)
        self.sockets = SocketWan({k: m for k, m in inp.links.items() if m.control is not None}, inp.sharing)
        self._socket_version = 0
        self._in_flight: dict[str, Key] = {}
        self._arrived: set[Key] = set()
        self._barrier: dict[tuple[int, int], list[tuple[int, float]]] = {}
        self._at_step: dict[tuple[int, int], list[int]] = {}  # (replica, iteration) -> slots at the collectives
        self._ends: dict[int, float] = {}
        self._finished: dict[int, int] = {}  # iteration -> slots done with it
        self._left = len(self.slots)
        self._on_iteration, self._on_done = on_iteration, on_done
        self.spans: list[Span] = []
        self.bubbles: list[Bubble] = []

    def start(self) -> None:
        for w in range(len(self.slots)):
            if self.guest is not None:
                self.guest.joined(w, self.predictors[w].typical(), 0.0)
            self.q.at(0.0, self._resume, w)

    def result(self) -> PipelineResult:
        if len(self._ends) != self.iterations:
            blocked = [repr(s.walk) for s in self.slots if s.walk.current() is not None]
            raise RuntimeError(f"the pipeline deadlocked; blocked slots: {blocked[:8]}")
        ends = [self._ends[i] for i in range(self.iterations)]
        return PipelineResult(self.spans, self.bubbles, ends, workers=len(self.slots), inputs=self.inp)

    def run(self) -> PipelineResult:
        """Start, run the queue dry, and return the result (the queue holds nothing else)."""
        self.start()
        self.q.run()
        return self.result()

    # --- the walk --------------------------------------------------------------------------

    def _resume(self, now: float, w: int) -> None:
        st = self.slots[w]
        walk = st.walk
        if st.blocked_since is not None:
            self._end_wait(st, w, now)
        inp, spans = self.inp, self.spans
        while (a := walk.current()) is not None:
            op = a.op
            if op is Op.FWD or op is Op.BWD:
                dur = (inp.fwd_s if op is Op.FWD else inp.bwd_s)[walk.stage]
                spans.append(Span(walk.replica, walk.stage, walk.iteration, op.value, now, now + dur, a.mb))
                walk.advance()
                self.q.at(now + dur, self._resume, w)
                return
            if op is Op.SEND_ACT or op is Op.SEND_GRAD:
                self._send(walk, now)
            elif op is Op.RECV_ACT or op is Op.RECV_GRAD:
                key = walk.awaited()
                if key not in self._arrived:
                    self._block(st, w, now)
                    return
                self._arrived.discard(key)
            elif op is Op.ALLREDUCE:
                walk.advance()
                self._allreduce(walk, w, now)
                return
            elif op is Phase.COLLECTIVES:
                if self._wait_at_step(st, w, now):
                    return
            elif op is Op.STEP:
                walk.advance()
                if inp.step_s > 0:
                    spans.append(Span(walk.replica, walk.stage, walk.iteration, "step", now, now + inp.step_s))
                self.q.at(now + inp.step_s, self._resume, w)
                return
            else:  # Phase.END
                self._finish_iteration(walk.iteration, now)
            walk.advance()

    def _block(self, st: _Slot, w: int, now: float) -> None:
        """Slot `w` waits for its input: a bubble (announced to the guest, if any)."""
        st.blocked_since = now
        if self.guest is not None:
            walk = st.walk
            predictor = self.predictors[w]
            st.predicted_s = predictor.predict(walk.pos)
            self.guest.bubble_start(w, walk.iteration, walk.pos, st.predicted_s, now, predictor.room(walk.pos))

    def _wait_at_step(self, st: _Slot, w: int, now: float) -> bool:
        """The collectives' barrier across the replica's stages: True if slot `w` waits there; the
        last stage to come releases the others, their collective a bus hop later."""
        d, it = st.walk.replica, st.walk.iteration
        waiting = self._at_step.setdefault((d, it), [])
        waiting.append(w)
        if len(waiting) < self.inp.stages:
            self._block(st, w, now)
            return True
        for peer in self._at_step.pop((d, it))[:-1]:
            self.q.at(now + self.bus_s, self._input_here, peer)
        return False

    def _end_wait(self, st: _Slot, w: int, now: float) -> None:
        """The bubble of slot `w` is over (its input came, and any running prefill block ended)."""
        assert st.blocked_since is not None
        walk = st.walk
        it, pos, length = walk.iteration, walk.pos, now - st.blocked_since
        if length > EPS:
            mb = walk.actions[pos].mb
            if self.guest is None:
                self.spans.append(Span(walk.replica, walk.stage, it, "wait", st.blocked_since, now, mb))
            else:
                self.spans.append(
                    Span(
                        walk.replica,
                        walk.stage,
                        it,
                        "wait",
                        st.blocked_since,
                        now,
                        mb,
                        st.predicted_s * 1000,
                        st.input_at,
                    )
                )
            self.bubbles.append(Bubble(walk.replica, walk.stage, it, pos, st.blocked_since, length))
        if self.guest is not None:
            self.predictors[w].observe(pos, st.predicted_s, length, it)
            self.guest.bubble_end(w, it, pos, now)
        st.blocked_since, st.resuming = None, False
        if walk.actions[pos].op is not Op.STEP:  # a receive: its tensor is taken
            self._arrived.discard(walk.awaited())
        walk.advance()  # past the receive, or past the collectives (the step runs next)

    def _allreduce(self, walk: SlotWalk, w: int, now: float) -> None:
        """A barrier of the stage's DP peers, then the cost, ending for all at one instant. The last
        peer's gradients cross the bus to the others (one hop) before they can be summed."""
        k, it = walk.stage, walk.iteration
        group = self._barrier.setdefault((k, it), [])
        group.append((w, now))
        if len(group) < self.inp.dp:
            return
        del self._barrier[(k, it)]
        last = max(t for _, t in group)
        cost = self.inp.allreduce_s[k] if self.inp.allreduce_s else 0.0
        done = last + (max(cost, self.bus_s) if self.inp.dp > 1 else cost)
        for peer, t0 in group:
            if done - t0 > EPS:
                self.spans.append(Span(self.slots[peer].walk.replica, k, it, "allreduce", t0, done))
            self.q.at(done, self._resume, peer)

    def _finish_iteration(self, it: int, now: float) -> None:
        self._ends[it] = max(self._ends.get(it, 0.0), now)
        self._finished[it] = self._finished.get(it, 0) + 1
        if self._finished[it] == len(self.slots) and self._on_iteration is not None:
            self._on_iteration(it, now)
        if it + 1 == self.iterations:
            self._left -= 1
            if self._left == 0 and self._on_done is not None:
                self._on_done(now)

    # --- tensors ---------------------------------------------------------------------------

    def _arrive(self, now: float, key: Key) -> None:
        self._arrived.add(key)
        w = key[0] * self.inp.stages + key[1]
        st = self.slots[w]
        if st.blocked_since is None or st.resuming or st.walk.current() is COLLECTIVES:
            return
        if st.walk.awaited() == key:
            self._input_here(now, w)

    def _input_here(self, now: float, w: int) -> None:
        """What blocked slot `w` waited for is here (a tensor, or the last stage at the step):
        training resumes now, or, with a guest, once the running prefill block ends."""
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

    def _send(self, walk: SlotWalk, now: float) -> None:
        key = walk.sent()
        d, dst, it, mb = key[0], key[1], key[3], key[4]
        src_dc, dst_dc = self.inp.stage_dc[walk.stage], self.inp.stage_dc[dst]
        if src_dc == dst_dc:  # straight to the peer's inbox: one hop
            self.q.at(now + self.bus_s, self._arrive, key)
            return
        lk = (src_dc, dst_dc)
        tid = f"{d}:{dst}:{key[2]}:{it}:{mb}"
        self._in_flight[tid] = key
        priority = transfer_priority(it, mb, d)
        if lk in self.sockets.links:  # the pair of workers: replica d's stages k and dst
            self.sockets.send(tid, lk, (d, min(walk.stage, dst)), self.inp.act_bytes, priority, now)
            self._pump_sockets(now)
            return
        self.links[lk].submit(tid, self.inp.act_bytes, priority, now)
        self._pump(now, lk)

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


def simulate(inp: PipelineInputs, iterations: int = 1) -> PipelineResult:
    """The analytic model: the engine with no bus hops and no guest."""
    return PipelineRun(inp, iterations, EventQueue()).run()


def priors(inp: PipelineInputs, iteration: int = 1) -> list[dict[int, float]]:
    """Each slot's bubble lengths by schedule position in `iteration` of the analytic model: a live
    worker's prior (`predict(spec, ..., iterations=2)` in services/stage_worker/worker.py), and
    the simulator's, so both start from the same numbers."""
    return simulate(inp, iteration + 1).bubbles_by_slot(iteration)
