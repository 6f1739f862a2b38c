"""Sharing one directed WAN link among concurrent transfers (pure; time is an input).

The same `LinkSharing` object runs inside the live `wan_broker` (fed by a real clock) and inside
the analytic pipeline model (fed by a virtual clock), so both obey one policy.

Physics of the emulated link:

* capacity ``bandwidth`` (bytes/s) and one-way ``latency``;
* one TCP connection carries at most ``window / RTT`` (RTT = 2 x latency), so a transfer split over
  ``connections`` connections is capped at ``flow_cap = min(bandwidth, connections * window / RTT)``;
* a transfer's last byte arrives ``latency`` after it leaves the sender.

Policies:

* ``fair``: processor sharing. Every submitted transfer transmits at once, each at
  ``min(flow_cap, bandwidth / n)``: D replicas sending together each get 1/D of the link and all
  finish late.
* ``temporal`` (Atlas): the link goes to one transfer at a time, in workload-aware order (see
  `transfer_priority`): the critical path first (earlier iteration and microbatch), then a stable
  order across DP replicas, so pipelines stagger and one replica computes while the next transfers.
  A started transfer is never preempted. If one transfer cannot fill the link (flow_cap <
  bandwidth, e.g. a single TCP connection) the next ones in order use the rest: the policy is
  work-conserving, so it never idles capacity that fair sharing would use.
* ``fifo``: like temporal but in submission order (a naive baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.config import LinkParams

POLICIES = ("fair", "temporal", "fifo")

MIB = 1 << 20


@dataclass(frozen=True)
class LinkModel:
    bandwidth: float  # bytes/s
    latency: float  # s, one way
    flow_cap: float  # bytes/s one transfer can reach over its connections

    @classmethod
    def from_params(cls, p: LinkParams) -> LinkModel:
        bandwidth = p.bandwidth_gbps * 1e9 / 8
        latency = p.latency_ms / 1000
        rtt = 2 * latency
        per_conn = p.tcp_window_mib * MIB / rtt if rtt > 0 else math.inf
        return cls(bandwidth=bandwidth, latency=latency, flow_cap=min(bandwidth, p.connections * per_conn))

    def alone_s(self, nbytes: int) -> float:
        """Time from start to arrival of one transfer that has the link to itself."""
        return nbytes / self.flow_cap + self.latency


def transfer_priority(iteration: int, microbatch: int, replica: int) -> tuple[int, int, int]:
    """Workload-aware order for temporal sharing: earlier iteration and microbatch first (they are
    on the critical path), then replica index, a stable order that staggers the DP pipelines."""
    return (iteration, microbatch, replica)


@dataclass(frozen=True)
class Sent:
    """A transfer whose last byte has left the sender."""

    id: str
    nbytes: int
    submitted: float
    started: float  # first byte on the wire
    tx_end: float  # last byte on the wire
    arrival: float  # last byte at the receiver (tx_end + latency)


@dataclass
class _Flow:
    id: str
    nbytes: int
    priority: tuple[int, ...]
    seq: int
    submitted: float
    remaining: float
    rate: float = 0.0
    started: float | None = None


@dataclass
class LinkStats:
    bytes_sent: float = 0.0
    busy_s: float = 0.0  # time with at least one byte in flight
    transfers: int = 0


# A flow is done when fewer bytes than this remain, or less than _EPS_S of sending: rates times
# float times leave crumbs, and far from t=0 a crumb's duration is below the clock's resolution
# (now + 1e-15 == now at t=15 s), which would otherwise stall the clock forever.
_EPS_BYTES = 1e-6
_EPS_S = 1e-9


@dataclass
class LinkSharing:
    model: LinkModel
    policy: str = "temporal"
    now: float = 0.0
    stats: LinkStats = field(default_factory=LinkStats)
    _flows: dict[str, _Flow] = field(default_factory=dict)
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
        self._flows[transfer_id] = _Flow(transfer_id, nbytes, tuple(priority), self._seq, now, float(nbytes))
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

    def _complete(self, f: _Flow) -> None:
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
            def order(f: _Flow) -> tuple[int, tuple[int, ...], int]:
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


def _is_done(f: _Flow) -> bool:
    return f.remaining <= _EPS_BYTES or f.remaining <= f.rate * _EPS_S


def _has_sent(f: _Flow) -> bool:
    return f.remaining < f.nbytes - _EPS_BYTES
