"""Cluster specs nobody tuned the models for: three or four datacenters, uneven links, either schedule.

`generated(n, seed)` draws `n` small specs that a 2-core machine trains live (a few KB of
activations, a device profile of tens of ms per stage), with one stage per datacenter or more:

* 3-4 datacenters of uneven sizes (Atlas places the largest first);
* PP = the datacenters or one more, DP 1-2, GPipe or 1F1B, 2-6 microbatches;
* WAN links of 1.5-8 ms and 2-8 Mb/s by default, with per-pair overrides (some asymmetric), so the
  hops of one pipeline differ;
* clipping by the global norm on or off (the step's cross-stage collectives, a bubble at the
  step's position, where it is on).

`bench/sim_vs_live.py --generated N` runs them live, simulated and in the analytic model;
tests/unit/test_sim_training.py checks the simulator against the analytic model on them.
"""

from __future__ import annotations

import random
from typing import Any

DC_NAMES = ("dc-a", "dc-b", "dc-c", "dc-d")


def generated_spec(rng: random.Random, index: int) -> dict[str, Any]:
    """One drawn spec, as plain data (`shared.config.spec.parse_spec` reads it)."""
    n_dc = rng.choice((3, 4))
    pp = n_dc + rng.choice((0, 1))
    dp = rng.choice((1, 2))
    schedule = "gpipe" if index % 2 else "1f1b"  # both schedules, whatever the draw
    # every DC holds at least one stage's replicas; the extra stage goes to a larger one
    sizes = [dp * (2 if i == 0 and pp > n_dc else 1) + rng.choice((0, dp)) for i in range(n_dc)]
    names = DC_NAMES[:n_dc]

    def link() -> dict[str, Any]:
        return {
            "latency_ms": round(rng.uniform(1.5, 8.0), 2),
            "bandwidth_gbps": round(rng.uniform(0.002, 0.008), 5),
        }

    overrides = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if rng.random() < 0.6:
                overrides.append({"src": a, "dst": b, "symmetric": rng.random() < 0.7, **link()})
    layers = pp * rng.choice((1, 2))
    return {
        "name": f"generated-{index}",
        "datacenters": [{"name": n, "gpus": g} for n, g in zip(names, sizes, strict=True)],
        "wan": {
            "sharing": rng.choice(("temporal", "fair")),
            "default": {**link(), "tcp_window_mib": 0.0009765625, "connections": 8},
            "links": overrides,
        },
        "model": {"layers": layers, "d_model": 32, "heads": 4, "seq_len": 32, "vocab": 256, "seed": 0},
        "parallelism": {"pp": pp, "dp": dp, "tp": 1},
        "training": {
            "schedule": schedule,
            "microbatches": rng.randint(2, 6),
            "microbatch_size": 2,
            "iterations": 8,
            "clip_grad_norm": rng.choice((0.0, 1.0)),
        },
        "device": {
            "fwd_ms_per_layer": round(rng.uniform(4.0, 12.0) / (layers // pp), 2),
            "allreduce_ms": round(rng.uniform(2.0, 15.0), 1),
            "step_ms": round(rng.uniform(1.0, 5.0), 1),
        },
        "bubbletea": {"enabled": False},
    }


def generated(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` drawn specs; the same `seed` draws the same ones."""
    rng = random.Random(seed)
    return [generated_spec(rng, i) for i in range(n)]
