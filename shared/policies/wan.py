"""Sharing one directed WAN link among concurrent transfers (pure; time is an input).

The same `LinkSharing` object runs inside the live `wan_broker` (fed by a real clock) and inside
the analytic pipeline model (fed by a virtual clock), so both obey one policy.

Physics of the emulated link:

* capacity ``bandwidth`` (bytes/s) and one-way ``latency``;
* one TCP connection carries at most ``window / RTT`` (RTT = 2 x latency), so a transfer split over
  ``connections`` connections is capped at ``flow_cap = min(bandwidth, connections * window / RTT)``;
* a transfer's last byte arrives ``latency`` after it leaves the sender.

What the link adds beyond the payload at its rate depends on how the WAN mode realises it
(`LinkModel.from_params(params, mode)`), so the model predicts what each mode's link does:

* ``model``: the broker's `LinkSharing` *is* the link: payload at ``bandwidth``, the spec's
  ``latency``, no control traffic. The live broker releases each receiver at exactly these
  arrival times, so a prediction and a model-mode run share one clock.
* ``kernel``: htb shapes every packet at its length on the wire (``overhead``: Ethernet, IP and
  TCP headers per full-size segment, `HEADER_OVERHEAD`), the namespaces add no propagation delay
  (no netem: ``latency`` 0; the spec's latency still sets the per-connection cap, window / RTT),
  and every transfer goes through the broker's slot protocol (`SlotControl`: bus hops before the
  first byte and after the last).
* ``none``: a real network: the headers and the slot protocol as in ``kernel``, the spec's latency.

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
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from itertools import chain

from shared.config.spec import LinkParams

POLICIES = ("fair", "temporal", "fifo")
#: The WAN modes (`wan.mode`): how cross-DC bytes meet the link (module docstring).
MODES = ("model", "kernel", "none")

MIB = 1 << 20

#: One TCP segment at a 1500-byte MTU as a shaper counts it: 1448 payload bytes (1500 - 20 IPv4
#: - 20 TCP - 12 of TCP timestamps, on by default in Linux) in a 1514-byte frame (+ 14 Ethernet).
MSS_BYTES = 1448
FRAME_BYTES = 1514
#: Wire bytes per payload byte on a link shaped per packet (htb charges each packet's length,
#: headers included): 1514 / 1448 = 1.0456, so goodput is 4.4 % below the link's rate. A
#: transfer's last, partial segment per connection costs a little more; left out (under 1 %
#: for the activations the benchmarks send: 16 KiB or more per connection).
HEADER_OVERHEAD = FRAME_BYTES / MSS_BYTES
#: One bus hop on one host: a message published by one process until a consumer in another runs
#: its handler. `bench/bus.py` measures two of them (`request_reply_p50_ms`, Ping and Pong back):
#: 0.68 ms on the project's 2-core machine (docs/benchmarks.md), so 0.34 ms each. Not fitted to any
#: benchmark of the WAN: it is the bus's own latency.
BUS_HOP_S = 0.00034


@dataclass(frozen=True)
class SlotControl:
    """The broker's slot protocol on one transfer (WAN modes `kernel` and `none`): the control
    messages a transfer's bytes wait for, as latencies. In order:

    * `request_s`: the sender's send until the broker has its `SlotRequest` (one bus hop);
    * `start_s`: the broker's grant until the first byte is on the wire: the `SlotGrant` to the
      sender, then its `TensorReady` to the receiver, which posts the receive (gloo moves
      announced bytes only once the receiver is ready for them): two hops;
    * `report_s`: the last byte landed until the broker frees the transfer's share of the link:
      the receiver's `SlotDone` (one hop). Under temporal sharing the link idles for
      `report_s + start_s` between one transfer's last byte and the next one's first.
    """

    request_s: float
    start_s: float
    report_s: float

    @classmethod
    def hops(cls, hop_s: float) -> SlotControl:
        """The protocol as bus hops of `hop_s` each: 1 before the grant, 2 after it, 1 to report."""
        return cls(request_s=hop_s, start_s=2 * hop_s, report_s=hop_s)


@dataclass(frozen=True)
class LinkModel:
    bandwidth: float  # bytes/s on the wire: the link's rate
    latency: float  # s, one way: from the last byte leaving the sender to its arrival
    flow_cap: float  # bytes/s (on the wire) one transfer can reach over its connections
    #: Wire bytes per payload byte (`HEADER_OVERHEAD` on a packet-shaped link); 1 = the link moves
    #: payload at `bandwidth`, as the model-mode emulation defines it. A transfer of n payload
    #: bytes lasts n x overhead / rate.
    overhead: float = 1.0
    #: The slot protocol's latencies where the broker grants the link (`kernel`, `none`); None
    #: where it emulates it (`model`: `LinkSharing` is the link, a transfer starts at its send).
    control: SlotControl | None = None

    @classmethod
    def from_params(cls, p: LinkParams, mode: str = "model") -> LinkModel:
        """The link `p` as WAN mode `mode` realises it (module docstring)."""
        if mode not in MODES:
            raise ValueError(f"unknown WAN mode {mode!r}; known: {', '.join(MODES)}")
        bandwidth = p.bandwidth_gbps * 1e9 / 8
        latency = p.latency_ms / 1000
        rtt = 2 * latency
        per_conn = p.tcp_window_mib * MIB / rtt if rtt > 0 else math.inf
        flow_cap = min(bandwidth, p.connections * per_conn)
        if mode == "model":
            return cls(bandwidth=bandwidth, latency=latency, flow_cap=flow_cap)
        return cls(
            bandwidth=bandwidth,
            latency=0.0 if mode == "kernel" else latency,  # no netem: the namespaces add no delay
            flow_cap=flow_cap,
            overhead=HEADER_OVERHEAD,
            control=SlotControl.hops(BUS_HOP_S),
        )

    @property
    def payload_bandwidth(self) -> float:
        """Payload bytes/s the whole link carries (goodput)."""
        return self.bandwidth / self.overhead

    @property
    def payload_cap(self) -> float:
        """Payload bytes/s one transfer can reach."""
        return self.flow_cap / self.overhead

    def alone_s(self, nbytes: int) -> float:
        """Time from the send to the arrival of one transfer that has the link to itself."""
        before = self.control.request_s + self.control.start_s if self.control is not None else 0.0
        return before + nbytes / self.payload_cap + self.latency


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
    key: tuple[tuple[int, ...], int] = ((), 0)  # place in the policy order: (priority or (), seq)
    sent_group: bool = False  # in `_sent` (has sent bytes), else in `_waiting`


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
    """One directed link's transfers under `policy`. Under temporal and fifo an event costs what it
    changes, not the number waiting: the transfers stay in policy order (`_sent`, then `_waiting`),
    an allocation walks only the head that gets bandwidth, and the clock moves only the flows with
    a rate (`_rated`). Results are those of re-sorting every flow at every change, bit for bit
    (tests/unit/test_wan_reference.py compares both on random inputs).

    Sizes and rates are payload bytes: a flow moves at most `model.payload_cap` and all of them
    together `model.payload_bandwidth` (the wire rates over the header `overhead`). The slot
    protocol's latencies (`model.control`) are not this object's: where the broker grants the
    link, the pipeline model runs `SlotArbiter` in front of a fair `LinkSharing` (the wire)."""

    model: LinkModel
    policy: str = "temporal"
    now: float = 0.0
    stats: LinkStats = field(default_factory=LinkStats)
    _flows: dict[str, _Flow] = field(default_factory=dict)  # in submission order
    _done: list[Sent] = field(default_factory=list)
    _seq: int = 0
    # flows whose rate is not 0, in submission order (under fair: all of them, or none)
    _rated: dict[str, _Flow] = field(default_factory=dict)
    # temporal / fifo: flows that have sent bytes, then the others, each sorted by `_Flow.key`
    _sent: list[tuple[tuple[tuple[int, ...], int], _Flow]] = field(default_factory=list)
    _waiting: list[tuple[tuple[tuple[int, ...], int], _Flow]] = field(default_factory=list)
    _low: dict[str, _Flow] = field(default_factory=dict)  # may have <= _EPS_BYTES left
    _dirty: bool = False  # the flows or their order changed since the last allocation
    _slot_rates: list[float] = field(default_factory=list)  # rate of the i-th flow in order
    _slot_left: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown sharing policy {self.policy!r}; known: {', '.join(POLICIES)}")
        self._slot_left = self.model.payload_bandwidth

    # --- the interface ---------------------------------------------------------------------

    def submit(self, transfer_id: str, nbytes: int, priority: tuple[int, ...], now: float) -> None:
        """A transfer of `nbytes` is ready to send at `now` (not earlier than the last call's time)."""
        if transfer_id in self._flows:
            raise ValueError(f"transfer {transfer_id!r} is already on this link")
        self._run_until(now)
        self._seq += 1
        f = _Flow(transfer_id, nbytes, tuple(priority), self._seq, now, float(nbytes))
        self._flows[transfer_id] = f
        if self.policy != "fair":
            f.key = (f.priority if self.policy == "temporal" else (), f.seq)
            insort(self._waiting, (f.key, f))
        if f.remaining <= _EPS_BYTES:
            self._low[transfer_id] = f
        self._dirty = True
        self._allocate()
        self._finish_empty()

    def advance(self, now: float) -> list[Sent]:
        """Move the clock to `now`; return the transfers that finished sending by then, in order."""
        self._run_until(now)
        done, self._done = self._done, []
        return done

    def next_tx_end(self) -> float | None:
        """When the next transfer will finish sending if nothing new is submitted (None if idle)."""
        ends = [self.now + f.remaining / f.rate for f in self._rated.values() if f.rate > 0]
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
        rated = list(self._rated.values())
        if dt > 0:
            # a flow without a rate keeps its bytes (x - 0.0 * dt == x) unless dt is infinite
            moved = rated
            if dt == math.inf:
                moved, self._dirty = list(self._flows.values()), True
            total = sum(f.rate for f in rated)  # the others add 0.0: the same sum
            if total > 0:
                self.stats.busy_s += dt
                self.stats.bytes_sent += total * dt
            ordered = self.policy != "fair"
            for f in moved:
                f.remaining -= f.rate * dt
                if f.remaining <= _EPS_BYTES:
                    self._low[f.id] = f
                if ordered and _has_sent(f) != f.sent_group:
                    self._regroup(f)
        self.now = t
        for f in rated:
            if f.rate > 0 and _is_done(f):
                self._complete(f)

    def _finish_empty(self) -> None:
        if self._low:
            for f in sorted(self._low.values(), key=_seq_of):
                if f.remaining <= _EPS_BYTES and self._flows.get(f.id) is f:
                    if f.started is None:
                        f.started = self.now
                    self._complete(f)
            self._low.clear()
        if len(self._rated) < len(self._flows):  # some flow has rate 0
            self._allocate()

    def _complete(self, f: _Flow) -> None:
        del self._flows[f.id]
        self._rated.pop(f.id, None)
        if self.policy != "fair":
            group = self._sent if f.sent_group else self._waiting
            del group[bisect_left(group, (f.key,))]
        self._dirty = True
        self.stats.transfers += 1
        started = f.started if f.started is not None else self.now
        self._done.append(Sent(f.id, f.nbytes, f.submitted, started, self.now, self.now + self.model.latency))

    def _regroup(self, f: _Flow) -> None:
        """`f` started (or, with no bytes sent after all, stopped) counting as sent: move its place."""
        old, new = (self._sent, self._waiting) if f.sent_group else (self._waiting, self._sent)
        del old[bisect_left(old, (f.key,))]
        insort(new, (f.key, f))
        f.sent_group = not f.sent_group
        self._dirty = True

    def _allocate(self) -> None:
        """Give every flow its rate under the policy (called whenever the set of flows changes).
        Depends only on the flows, their order and what they have sent, so with none of these
        changed since the last call it would change nothing."""
        if not self._dirty:
            return
        self._dirty = False
        if self.policy == "fair":
            flows = list(self._flows.values())
            cap, bw = self.model.payload_cap, self.model.payload_bandwidth
            share = min(cap, bw / len(flows)) if flows else 0.0
            for f in flows:
                f.rate = share
            self._rated = dict(self._flows) if share != 0 else {}
            for f in flows:
                if f.rate > 0 and f.started is None:
                    f.started = self.now
                elif f.rate == 0 and not _has_sent(f):
                    f.started = None
            return
        # Flows that have sent bytes keep their place (no preemption); the rest queue by policy
        # order. Several submitted at the same instant are therefore ordered by priority. The i-th
        # flow in that order always gets the same rate, and once one gets 0 so do all after it.
        rated: list[_Flow] = []
        for i, (_, f) in enumerate(chain(self._sent, self._waiting)):
            if (rate := self._slot_rate(i)) == 0:
                break
            f.rate = rate
            rated.append(f)
        new = {f.id for f in rated}
        for f in self._rated.values():
            if f.id not in new:
                f.rate = 0.0
                if not _has_sent(f):
                    f.started = None  # queued again before its first byte left
        for f in rated:
            if f.rate > 0 and f.started is None:
                f.started = self.now
        rated.sort(key=_seq_of)
        self._rated = {f.id: f for f in rated}

    def _slot_rate(self, i: int) -> float:
        """The rate of the i-th flow in policy order: what the cap and the link's rest leave it."""
        rates = self._slot_rates
        bw = self.model.payload_bandwidth
        while len(rates) <= i and not (rates and rates[-1] == 0):
            left = self._slot_left
            rate = min(self.model.payload_cap, left) if left > bw * 1e-12 else 0.0
            self._slot_left = left - rate
            rates.append(rate)
        return rates[i] if i < len(rates) else 0.0


def _seq_of(f: _Flow) -> int:
    return f.seq


def _is_done(f: _Flow) -> bool:
    return f.remaining <= _EPS_BYTES or f.remaining <= f.rate * _EPS_S


def _has_sent(f: _Flow) -> bool:
    return f.remaining < f.nbytes - _EPS_BYTES
