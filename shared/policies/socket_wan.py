"""Transfers over real sockets under the broker's slot protocol (pure; time is an input).

In WAN modes `kernel` and `none` the broker does not emulate the links: it grants them
(`SlotArbiter`), and the workers move the bytes themselves, over TCP connections that the links
carry. This is the analytic model of that path, what the pipeline model runs for such links in
place of a bare `LinkSharing`. Each transfer, in order:

1. **request**: the sender's `SlotRequest` reaches the arbiter `control.request_s` after the send;
2. **grant**: the arbiter grants by `wan.sharing` (the very `SlotArbiter` the broker runs);
3. **start**: `control.start_s` later the sender has the grant and the receiver, told by the
   sender's announcement, has posted its receive; the receiver's *ready notice* goes back to the
   sender over the pair's connections (gloo moves bytes only to a posted receive);
4. **bytes**: they go once the notice has crossed, then share the link (a fair `LinkSharing`:
   every transfer on the wire at most its cap, TCP's share);
5. **report**: the last byte lands `latency` after it left; the receiver's `SlotDone` frees its
   share of the link `control.report_s` later, and the arbiter grants the next.

Two rules come from the connections themselves (byte streams, in order), whatever the network:

* **One pair, one direction, in order.** The transfers between two workers in one direction (a
  replica's activations from stage k to k+1, say) go over the same connections, so the bytes of
  the next one follow the last byte of the one before; only different pairs share the link.
* **The ready notice waits behind the reverse bytes.** The notice travels on the same connections
  in the other direction, behind the bytes already written there (the pair's gradients, while
  its activations wait): the transfer's bytes start only once those are through, plus the one-way
  latency the notice takes.

Every time is on the caller's clock; nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from shared.policies.slots import Grant, SlotArbiter
from shared.policies.wan import LinkModel, LinkSharing, Sent

Link = tuple[str, str]  # (source DC, destination DC)


@dataclass
class _Transfer:
    id: str
    link: Link
    pair: Hashable
    nbytes: int
    priority: tuple[int, ...]
    submitted: float
    started: float | None = None  # first byte on the wire


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    run: Callable[[float], None] = field(compare=False)


@dataclass
class SocketWan:
    """The granted links of one WAN, with `send`, `advance` and `next_time` like `LinkSharing`'s
    `submit`, `advance` and `next_tx_end`. Every link's model must have a `control`."""

    links: dict[Link, LinkModel]
    policy: str = "temporal"
    now: float = 0.0
    _arbiters: dict[Link, SlotArbiter] = field(default_factory=dict)
    _wires: dict[Link, LinkSharing] = field(default_factory=dict)
    _transfers: dict[str, _Transfer] = field(default_factory=dict)
    #: per (link, pair): the transfers whose bytes are written, in order; the first is on the wire
    _written: dict[tuple[Link, Hashable], deque[str]] = field(default_factory=dict)
    #: transfer id -> transfers whose ready notice waits behind its bytes
    _notices: dict[str, list[str]] = field(default_factory=dict)
    _events: list[_Event] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _done: list[Sent] = field(default_factory=list)

    def __post_init__(self) -> None:
        for link, model in self.links.items():
            if model.control is None:
                raise ValueError(f"link {link[0]} -> {link[1]} has no slot protocol (LinkModel.control): not granted")
            self._arbiters[link] = SlotArbiter(model, self.policy)
            self._wires[link] = LinkSharing(model, "fair")

    # --- the interface ---------------------------------------------------------------------

    def send(
        self, transfer_id: str, link: Link, pair: Hashable, nbytes: int, priority: tuple[int, ...], now: float
    ) -> None:
        """A worker sends `nbytes` over `link` at `now`, between the two workers `pair` names (the
        same value for both directions of one pair of workers)."""
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already under way")
        control = self.links[link].control
        assert control is not None
        self._run_until(now)
        self._transfers[transfer_id] = _Transfer(transfer_id, link, pair, nbytes, tuple(priority), now)
        self._at(now + control.request_s, functools.partial(self._request, transfer_id))

    def advance(self, now: float) -> list[Sent]:
        """Move the clock to `now`; the transfers whose last byte left by then, in order (each
        arrives at its `arrival`, possibly later than `now`)."""
        self._run_until(now)
        done, self._done = self._done, []
        return done

    def next_time(self) -> float | None:
        """When something next happens if nothing new is sent (None: nothing under way)."""
        times = [e for w in self._wires.values() if (e := w.next_tx_end()) is not None]
        if self._events:
            times.append(self._events[0].time)
        return min(times) if times else None

    def in_flight(self) -> int:
        return len(self._transfers)

    # --- the protocol ----------------------------------------------------------------------

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, _Event(t, next(self._seq), fn))

    def _request(self, tid: str, now: float) -> None:
        tr = self._transfers[tid]
        self._granted(tr.link, self._arbiters[tr.link].request(tid, tr.nbytes, tr.priority, now), now)

    def _granted(self, link: Link, grants: list[Grant], now: float) -> None:
        control = self.links[link].control
        assert control is not None
        for g in grants:
            self._at(now + control.start_s, functools.partial(self._notice, g.id))

    def _notice(self, tid: str, now: float) -> None:
        """The receive is posted: its ready notice goes back behind the reverse bytes written so far."""
        tr = self._transfers[tid]
        reverse = self._written.get(((tr.link[1], tr.link[0]), tr.pair))
        if reverse:
            self._notices.setdefault(reverse[-1], []).append(tid)
        else:
            self._at(now + self._notice_latency(tr), functools.partial(self._write, tid))

    def _notice_latency(self, tr: _Transfer) -> float:
        reverse = self.links.get((tr.link[1], tr.link[0]))
        return (reverse or self.links[tr.link]).latency

    def _write(self, tid: str, now: float) -> None:
        """The sender has the notice: its bytes go into the pair's connections, after those before."""
        tr = self._transfers[tid]
        queue = self._written.setdefault((tr.link, tr.pair), deque())
        queue.append(tid)
        if len(queue) == 1:
            self._on_wire(tr, now)

    def _on_wire(self, tr: _Transfer, now: float) -> None:
        tr.started = now
        wire = self._wires[tr.link]
        wire.submit(tr.id, tr.nbytes, (), now)
        for s in wire.advance(now):  # an empty transfer is through at once
            self._sent(tr.link, s)

    def _sent(self, link: Link, s: Sent) -> None:
        """`s`'s last byte left: the pair's next goes on, the notices behind it cross, it lands."""
        tr = self._transfers.pop(s.id)
        model = self.links[link]
        control = model.control
        assert control is not None
        queue = self._written[(link, tr.pair)]
        queue.popleft()
        if queue:
            self._on_wire(self._transfers[queue[0]], s.tx_end)
        else:
            del self._written[(link, tr.pair)]
        for waiting in self._notices.pop(s.id, []):
            self._at(s.tx_end + self._notice_latency(self._transfers[waiting]), functools.partial(self._write, waiting))
        started = tr.started if tr.started is not None else s.started
        self._done.append(Sent(s.id, tr.nbytes, tr.submitted, started, s.tx_end, s.arrival))
        self._at(s.arrival + control.report_s, functools.partial(self._report, link, s.id))

    def _report(self, link: Link, tid: str, now: float) -> None:
        self._granted(link, self._arbiters[link].done(tid, now), now)

    def _run_until(self, t: float) -> None:
        if t < self.now - 1e-12:
            raise ValueError(f"time went backwards on the WAN: {t} < {self.now}")
        while True:
            wire_next = min(
                ((e, link) for link, w in self._wires.items() if (e := w.next_tx_end()) is not None),
                default=None,
            )
            event_next = self._events[0].time if self._events else None
            if wire_next is not None and wire_next[0] <= t and (event_next is None or wire_next[0] <= event_next):
                when, link = wire_next
                self.now = max(self.now, when)
                for s in self._wires[link].advance(when):
                    self._sent(link, s)
            elif event_next is not None and event_next <= t:
                ev = heapq.heappop(self._events)
                self.now = max(self.now, ev.time)
                ev.run(ev.time)
            else:
                break
        self.now = max(self.now, t)
