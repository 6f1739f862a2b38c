"""bench/control_plane.py's figures: one case's row from what its processes reported and spent, and
the sizing of a job from the measured per-input costs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from shared.figures.percentiles import percentile

if TYPE_CHECKING:
    from bench.lib.cp_case import Backend
    from bench.lib.cp_mix import Mix

#: What one process may use of a core in the sizing (headroom for bursts and recovery).
CORE_BUDGET = 0.7
#: A case is driven when the inputs measured reach this share of the mix offered.
DRIVEN_SHARE = 0.9
DECISION_P99_MS = 2.0


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or math.isnan(x) else round(x, nd)


def _per_input_us(cpu_s: float, inputs: int) -> float | None:
    return round(1e6 * cpu_s / inputs, 2) if inputs else None


def _dispatchers(used: list[float], inputs: int, seconds: float) -> dict[str, Any]:
    """The dispatchers' figures from each one's CPU seconds `used`: all together, and the busiest."""
    total = sum(used)
    return {
        "cpu": round(total / seconds, 3),
        "cpu_us_per_input": _per_input_us(total, inputs),
        "processes": len(used),
        "busiest_cpu": round(max(used) / seconds, 3),
    }


def figures(
    arm: str,
    mix: Mix,
    seconds: float,
    backend: Backend,
    outs: list[dict[str, Any]],
    accepted: int | None,
    used: list[float],
    commands: list[int | None],
    memory: list[int | None],
    beat: dict[str, Any],
    dispatchers: int = 1,
) -> dict[str, Any]:
    """One case's row. `used`: CPU seconds in the window of each of the `dispatchers` (one, or one
    per datacenter), each node, each worker process and the front door, in that order. The
    dispatcher's figures are all of them together (its cost a input, to compare with one's), and the
    busiest's share of a core."""
    workers, front = outs[:-1], outs[-1]
    ours, used = used[:dispatchers], [sum(used[:dispatchers]), *used[dispatchers:]]

    def total(k: str) -> int:
        return sum(int(o.get(k, 0)) for o in workers)

    waits = [x for o in workers for x in o.get("start_to_work_ms", [])]
    requests = accepted if accepted is not None else int(front.get("answers_in_window", 0))
    starts, ends, reports = total("bubble_starts"), total("bubble_ends"), total("reports")
    inputs = requests + starts + ends + reports
    n = len(backend.nodes)
    nodes = [
        {
            "role": node.role,
            "port": node.port,
            "cpu": round(used[1 + i] / seconds, 3),
            "cpu_us_per_input": _per_input_us(used[1 + i], inputs),
            "commands_per_input": round(commands[i] / inputs, 2) if commands[i] is not None and inputs else None,
            "used_memory_bytes": memory[i],
        }
        for i, node in enumerate(backend.nodes)
    ]
    p99 = beat.get("decision_ms_p99")
    driven = inputs / seconds >= DRIVEN_SHARE * mix.inputs_per_s
    return {
        "arm": arm,
        "mix_gpus": mix.gpus,
        "workers": mix.workers,
        "offered": {
            "inputs_per_s": round(mix.inputs_per_s, 1),
            "requests_per_s": round(mix.requests_per_s, 1),
            "bubble_events_per_s": round(2 * mix.bubbles_per_s, 1),
            "reports_per_s": round(mix.reports_per_s, 1),
        },
        "measured": {
            "inputs_per_s": round(inputs / seconds, 1),
            "requests_per_s": round(requests / seconds, 1),
            "bubble_events_per_s": round((starts + ends) / seconds, 1),
            "reports_per_s": round(reports / seconds, 1),
            "batches_read_per_s": round(total("batch_reads") / seconds, 1),
            "lease_renewals_per_s": round(total("renewals") / seconds, 1),
            "answers_read_per_s": round(int(front.get("answers_in_window", 0)) / seconds, 1),
        },
        "inputs": inputs,
        "sent": front.get("sent"),
        "answered": total("answered"),
        "driven": driven,
        "dispatcher": _dispatchers(ours, inputs, seconds),
        "redis_nodes": nodes,
        "emulator_cpu": round(sum(used[1 + n : -1]) / seconds, 3),
        "front_door_cpu": round(used[-1] / seconds, 3),
        "decision_p50_ms": beat.get("decision_ms_p50"),
        "decision_p99_ms": p99,
        "bubble_start_to_work_p50_ms": _r(percentile(waits, 50)),
        "bubble_start_to_work_p99_ms": _r(percentile(waits, 99)),
        "bubbles_with_work_share": round(len(waits) / starts, 3) if starts else None,
        "bubble_start_to_work_samples": len(waits),
        "refused": beat.get("overloaded"),
        "expired": beat.get("expired"),
        "held": driven and p99 is not None and p99 < DECISION_P99_MS,
    }


def sizing(row: dict[str, Any], inputs_per_s: float) -> dict[str, Any]:
    """What a job taking `inputs_per_s` dispatcher inputs needs at `row`'s measured costs a input,
    each process at CORE_BUDGET of a core. Shards and dispatchers assume the load spreads evenly over
    them (a hash tag per datacenter and a dispatcher per datacenter: not built yet); `one_*` is what
    one master and one dispatcher would carry, as a run is placed now (one run, one hash tag)."""
    d_us = row["dispatcher"]["cpu_us_per_input"]
    masters = [n for n in row["redis_nodes"] if n["role"] == "master" and n["cpu_us_per_input"] is not None]
    replicas = [n for n in row["redis_nodes"] if n["role"] == "replica" and n["cpu_us_per_input"] is not None]
    if not d_us or not masters:
        return {"why": "no per-input cost measured"}
    # every master's cost per input, summed: what the whole job costs the masters, wherever it lands
    m_us = sum(n["cpu_us_per_input"] for n in masters)
    r_us = sum(n["cpu_us_per_input"] for n in replicas)
    d_cores, m_cores, r_cores = inputs_per_s * d_us / 1e6, inputs_per_s * m_us / 1e6, inputs_per_s * r_us / 1e6
    shards = max(1, math.ceil(m_cores / CORE_BUDGET), math.ceil(r_cores / CORE_BUDGET))
    return {
        "inputs_per_s": round(inputs_per_s),
        "dispatcher_cores": round(d_cores, 2),
        "dispatchers_at_0_7_core": max(1, math.ceil(d_cores / CORE_BUDGET)),
        "redis_master_cores": round(m_cores, 2),
        "redis_replica_cores": round(r_cores, 2) if replicas else None,
        "shards_at_0_7_core": shards,
        "one_dispatcher_under_0_7_core": d_cores < CORE_BUDGET,
        "one_master_under_0_7_core": m_cores < CORE_BUDGET,
        "fits_3_shards_under_0_7_core": m_cores / 3 < CORE_BUDGET and r_cores / 3 < CORE_BUDGET,
    }


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def marginal(rows: list[dict[str, Any]], inputs_per_s: float) -> dict[str, Any]:
    """The same sizing from the marginal cost: each process's core share against the inputs a
    second over `rows` (the held cases of one mix and arm), a line (a fixed part, the timer and
    polls, plus a cost a input), extrapolated to `inputs_per_s`. None with fewer than 2 cases."""
    if len({r["workers"] for r in rows}) < 2:
        return {"why": "fewer than 2 held cases of the mix"}
    xs = [r["measured"]["inputs_per_s"] for r in rows]
    a, b = _line(xs, [r["dispatcher"]["cpu"] for r in rows])
    masters = [i for i, n in enumerate(rows[0]["redis_nodes"]) if n["role"] == "master"]
    ma, mb = _line(xs, [sum(r["redis_nodes"][i]["cpu"] for i in masters) for r in rows])
    d_cores, m_cores = a + b * inputs_per_s, ma + mb * inputs_per_s
    return {
        "from_cases": len(rows),
        "dispatcher_fixed_cores": round(a, 3),
        "dispatcher_us_per_input": round(1e6 * b, 2),
        "redis_masters_fixed_cores": round(ma, 3),
        "redis_masters_us_per_input": round(1e6 * mb, 2),
        "dispatcher_cores": round(d_cores, 2),
        "dispatchers_at_0_7_core": max(1, math.ceil(d_cores / CORE_BUDGET)),
        "redis_master_cores": round(m_cores, 2),
        "shards_at_0_7_core": max(1, math.ceil(m_cores / CORE_BUDGET)),
        "fits_3_shards_under_0_7_core": m_cores / 3 < CORE_BUDGET,
    }
