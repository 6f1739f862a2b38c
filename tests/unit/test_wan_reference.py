"""The optimised `LinkSharing` against the full-recompute algorithm it replaced, kept here verbatim
(`RefLinkSharing`): long random sequences of submit / advance / next_tx_end under every policy,
window-capped flows included, must give identical outputs and state at every step (exact float
equality)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from shared.policies.wan import POLICIES, LinkModel, LinkSharing, LinkStats, Sent

_EPS_BYTES = 1e-6
_EPS_S = 1e-9


@dataclass
class _RefFlow:
    id: str
    nbytes: int
    priority: tuple[int, ...]
    seq: int
    submitted: float
    remaining: float
    rate: float = 0.0
    started: float | None = None


@dataclass
class RefLinkSharing:
    """The algorithm before the ordered structures, verbatim: re-sorts every flow at every change."""

    model: LinkModel
    policy: str = "temporal"
    now: float = 0.0
    stats: LinkStats = field(default_factory=LinkStats)
    _flows: dict[str, _RefFlow] = field(default_factory=dict)
    _done: list[Sent] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown sharing policy {self.policy!r}; known: {', '.join(POLICIES)}")

    # --- the interface ---------------------------------------------------------------------

    def submit(self, transfer_id: str, nbytes: int, priority: tuple[int, ...], now: float) -> None:
        """A transfer of `nbytes` is ready to send at `now` (not earlier than the last call's time)."""
        if transfer_id in self._flows:
            raise ValueError(f"transfer {transfer_id!r} is already on this link")
        self._run_until(now)
        self._seq += 1
        self._flows[transfer_id] = _RefFlow(transfer_id, nbytes, tuple(priority), self._seq, now, float(nbytes))
        self._allocate()
        self._finish_empty()

    def advance(self, now: float) -> list[Sent]:
        """Move the clock to `now`; return the transfers that finished sending by then, in order."""
        self._run_until(now)
        done, self._done = self._done, []
        return done

    def next_tx_end(self) -> float | None:
        """When the next transfer will finish sending if nothing new is submitted (None if idle)."""
        ends = [self.now + f.remaining / f.rate for f in self._flows.values() if f.rate > 0]
        return min(ends) if ends else None

    def in_flight(self) -> int:
        return len(self._flows)

    # --- mechanics -------------------------------------------------------------------------

    def _run_until(self, t: float) -> None:
        if t < self.now - 1e-12:
            raise ValueError(f"time went backwards on the link: {t} < {self.now}")
        while True:
            nxt = self.next_tx_end()
            if nxt is None or nxt > t:
                self._progress(max(t, self.now))
                return
            self._progress(nxt)
            self._allocate()
            self._finish_empty()

    def _progress(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            total = sum(f.rate for f in self._flows.values())
            if total > 0:
                self.stats.busy_s += dt
                self.stats.bytes_sent += total * dt
            for f in self._flows.values():
                f.remaining -= f.rate * dt
        self.now = t
        for f in list(self._flows.values()):
            if f.rate > 0 and _is_done(f):
                self._complete(f)

    def _finish_empty(self) -> None:
        for f in list(self._flows.values()):
            if f.remaining <= _EPS_BYTES:
                if f.started is None:
                    f.started = self.now
                self._complete(f)
        if any(f.rate == 0 for f in self._flows.values()):
            self._allocate()

    def _complete(self, f: _RefFlow) -> None:
        del self._flows[f.id]
        self.stats.transfers += 1
        started = f.started if f.started is not None else self.now
        self._done.append(Sent(f.id, f.nbytes, f.submitted, started, self.now, self.now + self.model.latency))

    def _allocate(self) -> None:
        """Give every flow its rate under the policy (called whenever the set of flows changes)."""
        flows = list(self._flows.values())
        cap, bw = self.model.flow_cap, self.model.bandwidth
        if self.policy == "fair":
            share = min(cap, bw / len(flows)) if flows else 0.0
            for f in flows:
                f.rate = share
        else:
            # Flows that have sent bytes keep their place (no preemption); the rest queue by policy
            # order. Several submitted at the same instant are therefore ordered by priority.
            def order(f: _RefFlow) -> tuple[int, tuple[int, ...], int]:
                return (0 if _has_sent(f) else 1, f.priority if self.policy == "temporal" else (), f.seq)

            left = bw
            for f in sorted(flows, key=order):
                f.rate = min(cap, left) if left > bw * 1e-12 else 0.0
                left -= f.rate
        for f in flows:
            if f.rate > 0 and f.started is None:
                f.started = self.now
            elif f.rate == 0 and not _has_sent(f):
                f.started = None  # queued again before its first byte left


def _is_done(f: _RefFlow) -> bool:
    return f.remaining <= _EPS_BYTES or f.remaining <= f.rate * _EPS_S


def _has_sent(f: _RefFlow) -> bool:
    return f.remaining < f.nbytes - _EPS_BYTES


MODELS = [
    LinkModel(100.0, 1.0, 100.0),  # one flow fills the link
    LinkModel(100.0, 1.0, 40.0),  # 40 + 40 + a residual 20
    LinkModel(100.0, 0.5, 30.0),  # 30 x 3 + 10
    LinkModel(100, 1, 100),  # ints
    LinkModel(1e3, 0.02, 7.0),  # many flows at once
    LinkModel(50.0, 0.0, 50.0 / 3),  # rounding in the link's rest
    LinkModel(400e9 / 8, 0.02, 64 * 6 * (1 << 20) / 0.04),  # the scale bench
]


def _state(link: LinkSharing | RefLinkSharing) -> tuple[object, ...]:
    flows = [(f.id, f.remaining, f.rate, f.started, f.submitted) for f in link._flows.values()]
    s = link.stats
    return (link.now, flows, s.bytes_sent, s.busy_s, s.transfers, link.in_flight(), link.next_tx_end())


def _drive(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    policy = POLICIES[seed % 3]
    model = MODELS[(seed // 3) % len(MODELS)]
    ref, opt = RefLinkSharing(model, policy), LinkSharing(model, policy)
    ids: list[str] = []
    scale = model.flow_cap  # bytes a flow sends in a second
    for step in range(steps):
        nxt = ref.next_tx_end()
        assert opt.next_tx_end() == nxt
        r = rng.random()
        if nxt is None or rng.random() < 0.3:
            t = ref.now + rng.choice([0.0, 0.0, rng.random() * 0.1, rng.random() * 3])
        else:
            t = rng.choice([nxt, nxt, ref.now, nxt + 1e-13, (ref.now + nxt) / 2, nxt + rng.random()])
        if r < 0.5:
            tid = rng.choice(ids) if ids and rng.random() < 0.1 else f"t{step}"
            ids.append(tid)
            nbytes = rng.choice([0, 1, int(scale), int(scale * rng.random() * 4), rng.randrange(1, 10_000_000)])
            prio = tuple(rng.randrange(3) for _ in range(rng.choice([1, 3, 3])))
            errs = []
            for link in (ref, opt):
                try:
                    link.submit(tid, nbytes, prio, t)
                except ValueError as e:
                    errs.append(str(e))
            assert len(errs) in (0, 2) and errs[:1] == errs[1:]
        else:
            a, b = ref.advance(t), opt.advance(t)
            assert a == b, (seed, step)
        assert _state(ref) == _state(opt), (seed, step, policy, model)
    while (t := ref.next_tx_end()) is not None:
        assert ref.advance(t) == opt.advance(t)
        assert _state(ref) == _state(opt)
    assert opt.next_tx_end() is None


@pytest.mark.parametrize("seed", range(0, 63))
def test_same_as_full_recompute(seed: int) -> None:
    _drive(seed, 400)


def test_same_as_full_recompute_bursts() -> None:
    """Many transfers at one instant (one per DP replica), drained event by event."""
    for policy in POLICIES:
        for model in MODELS:
            ref, opt = RefLinkSharing(model, policy), LinkSharing(model, policy)
            rng = random.Random(policy)
            for burst in range(4):
                t = ref.now + 0.01 * burst
                for d in rng.sample(range(64), 64):
                    for link in (ref, opt):
                        link.submit(f"{burst}:{d}", 16 << 20, (burst, d % 3, d), t)
                    assert _state(ref) == _state(opt)
                for _ in range(20):
                    if (nxt := ref.next_tx_end()) is None:
                        break
                    assert ref.advance(nxt) == opt.advance(nxt)
                    assert _state(ref) == _state(opt)
            assert ref.advance(math.inf) == opt.advance(math.inf)
            assert _state(ref) == _state(opt)
