"""BubbleTea's packing policy: which queued prefill requests go to one worker's queue (pure).

Inputs: the candidates (prompt length, the layer each would resume at, deadline, arrival, KV
memory) in queue order, the worker's room (its credit not in use: `shared.policies.dispatch`) and
free memory, and a cost function. Output: a plan of whole requests. Rules:

* **Room**: requests are planned while the plan's predicted time is under the room; the last may
  go past it (by less than one request): a request is never cut to fit, since a worker runs what
  it holds across as many of its bubbles as it takes.
* **Order** (configurable): ``deadline`` = earliest deadline first (requests without one after
  those with one), then arrival; ``arrival`` = arrival order.
* **Memory**: the KV cache of every planned request must fit in the worker's free memory; one
  that does not is left for a worker with more.
* **Expired**: a request whose deadline has passed is not planned (the dispatch policy fails it).

`pack` sorts its candidates; `pack_ordered` takes them already in order (a `WaitingQueue`, which
keeps a dispatcher's queue sorted as requests come and go) and reads only as many as the plan needs.
Both make the same plan.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Candidate:
    id: str
    tokens: int
    next_layer: int  # layers already done (0 = fresh)
    arrival: float
    kv_bytes: int  # KV cache size once complete
    deadline: float | None = None


@dataclass(frozen=True)
class Assignment:
    id: str
    from_layer: int
    to_layer: int  # run layers [from_layer, to_layer)
    seconds: float  # predicted


@dataclass(frozen=True)
class Plan:
    assignments: tuple[Assignment, ...]
    room_s: float


#: Room left below this is none (a nanosecond): float dust never lets one more request in.
ROOM_EPS_S = 1e-9

#: cost(tokens, from_layer, to_layer) -> predicted seconds to run those layers of that prompt
Cost = Callable[[int, int, int], float]


def layered_cost(whole: Callable[[int], float], layers: int) -> Cost:
    """Split a whole-prompt cost evenly over layers (blocks dominate a prefill's time)."""

    def cost(tokens: int, start: int, end: int) -> float:
        return whole(tokens) * (end - start) / layers

    return cost


def queue_key(order: str) -> Callable[[float | None, float], tuple[float, ...]]:
    """A request's place in the queue, from its deadline and arrival."""
    if order == "deadline":
        return lambda deadline, arrival: (0 if deadline is not None else 1, deadline or 0.0, arrival)
    if order == "arrival":
        return lambda deadline, arrival: (arrival,)
    raise ValueError(f"unknown order {order!r}; known: deadline, arrival")


def order_key(order: str) -> Callable[[Candidate], tuple[float, ...]]:
    key = queue_key(order)
    return lambda c: key(c.deadline, c.arrival)


def pack(
    candidates: Sequence[Candidate],
    *,
    room_s: float,
    free_memory: int,
    layers: int,
    cost: Cost,
    now: float,
    max_requests: int,
    order: str = "deadline",
) -> Plan:
    return pack_ordered(
        sorted(candidates, key=order_key(order)),
        room_s=room_s,
        free_memory=free_memory,
        layers=layers,
        cost=cost,
        now=now,
        max_requests=max_requests,
    )


def pack_ordered(
    ordered: Iterable[Candidate],
    *,
    room_s: float,
    free_memory: int,
    layers: int,
    cost: Cost,
    now: float,
    max_requests: int,
) -> Plan:
    """`pack` of candidates already in packing order (ties as they come); reads no more of
    `ordered` than the plan needs, so a long queue costs only its head."""
    left, memory = room_s, free_memory
    plan: list[Assignment] = []
    for c in ordered:
        if len(plan) >= max_requests or left <= ROOM_EPS_S:
            break
        if c.deadline is not None and c.deadline < now:
            continue  # expired: not planned
        if c.kv_bytes > memory:
            continue  # its KV cache does not fit on this worker now; a roomier one takes it
        whole = cost(c.tokens, c.next_layer, layers)
        plan.append(Assignment(c.id, c.next_layer, layers, whole))
        left -= whole
        memory -= c.kv_bytes
    return Plan(tuple(plan), room_s)


class WaitingQueue:
    """Request ids in packing order, kept sorted as requests are queued and taken, so that packing
    a bubble reads the head of the queue instead of sorting all of it.

    The order is `order_key`'s, ties in the order the requests became known (`know`), as `pack`
    orders candidates listed in that order. A known request keeps its place while it is out of
    the queue (running on a worker) and comes back to it (`put`)."""

    __slots__ = ("_entries", "_key", "_known", "_sorted")

    def __init__(self, order: str) -> None:
        self._key = queue_key(order)  # an unknown order fails here
        self._known = 0
        self._entries: dict[str, tuple[Any, ...]] = {}  # every known request's (*key, rank, id)
        self._sorted: list[tuple[Any, ...]] = []  # the queued ones' entries, in order

    def know(self, id: str, deadline: float | None, arrival: float) -> None:
        self._known += 1
        self._entries[id] = (*self._key(deadline, arrival), self._known, id)

    def put(self, id: str) -> None:
        insort(self._sorted, self._entries[id])

    def take(self, id: str) -> None:
        entry = self._entries[id]
        i = bisect_left(self._sorted, entry)
        if i < len(self._sorted) and self._sorted[i] == entry:
            del self._sorted[i]

    def forget(self, id: str) -> None:
        """`id` is gone for good (answered or failed): out of the queue and unknown."""
        self.take(id)
        del self._entries[id]

    def __iter__(self) -> Iterator[str]:
        return (entry[-1] for entry in self._sorted)

    def __len__(self) -> int:
        return len(self._sorted)
