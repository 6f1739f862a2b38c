"""BubbleTea's packing policy: which queued prefill requests go into one bubble (pure).

Inputs: the candidates (prompt length, the layer each would resume at, deadline, arrival, KV
memory), the bubble's remaining budget and the worker's free memory, and a cost function. Output:
a plan of layer ranges to run. Rules:

* **Budget**: predicted bubble length minus the guard and the dispatch overhead minus the time
  already elapsed; the plan's predicted time never exceeds it.
* **Order** (configurable): ``deadline`` = earliest deadline first (requests without one after
  those with one), then arrival; ``arrival`` = arrival order.
* **Memory**: the KV cache of every planned request must fit in the worker's free memory.
* **Longer than a bubble**: a request that does not fit whole, when it is next in order, runs as
  many whole layers as fit; it resumes at that layer in a later bubble, so any request completes
  across bubbles. Only the head of the queue is split, so a long request is not starved by short
  ones behind it, and it is never overtaken once started.
* **Expired**: a request whose deadline has passed is not planned (the dispatch policy fails it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


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
    budget_s: float


#: cost(tokens, from_layer, to_layer) -> predicted seconds to run those layers of that prompt
Cost = Callable[[int, int, int], float]


def layered_cost(whole: Callable[[int], float], layers: int) -> Cost:
    """Split a whole-prompt cost evenly over layers (blocks dominate a prefill's time)."""

    def cost(tokens: int, start: int, end: int) -> float:
        return whole(tokens) * (end - start) / layers

    return cost


def budget(predicted_s: float, elapsed_s: float, guard_s: float, overhead_s: float) -> float:
    """What a bubble still offers to prefill."""
    return max(0.0, predicted_s - guard_s - overhead_s - elapsed_s)


def order_key(order: str) -> Callable[[Candidate], tuple[float, ...]]:
    if order == "deadline":
        return lambda c: (0 if c.deadline is not None else 1, c.deadline or 0.0, c.arrival)
    if order == "arrival":
        return lambda c: (c.arrival,)
    raise ValueError(f"unknown order {order!r}; known: deadline, arrival")


def pack(
    candidates: Sequence[Candidate],
    *,
    budget_s: float,
    free_memory: int,
    layers: int,
    cost: Cost,
    now: float,
    max_requests: int,
    order: str = "deadline",
) -> Plan:
    live = sorted((c for c in candidates if c.deadline is None or c.deadline >= now), key=order_key(order))
    left, memory = budget_s, free_memory
    plan: list[Assignment] = []
    for c in live:
        if len(plan) >= max_requests or left <= 0:
            break
        if c.kv_bytes > memory:
            continue  # its KV cache does not fit on this worker now; a roomier bubble takes it
        whole = cost(c.tokens, c.next_layer, layers)
        if whole <= left:
            plan.append(Assignment(c.id, c.next_layer, layers, whole))
            left -= whole
            memory -= c.kv_bytes
            continue
        per_layer = cost(c.tokens, c.next_layer, c.next_layer + 1)
        fit = math.floor(left / per_layer) if per_layer > 0 else 0
        if fit >= 1:
            end = min(layers, c.next_layer + fit)
            secs = cost(c.tokens, c.next_layer, end)
            plan.append(Assignment(c.id, c.next_layer, end, secs))
            memory -= c.kv_bytes
        break  # the head of the queue takes the rest of the bubble: no overtaking it
    return Plan(tuple(plan), budget_s)
