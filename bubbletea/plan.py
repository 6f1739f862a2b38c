"""The text `bubbletea plan` prints: the placement, the WAN hops and the analytic model's numbers."""

from __future__ import annotations

from typing import Any

from shared.config.spec import ClusterSpec
from shared.policies.pipeline_plan import activation_bytes, layers_per_stage, placement_of, predict
from shared.policies.schedules import compute_bubble_fraction
from shared.policies.wan import LinkModel

#: How `bubbletea plan` names each `parallelism.placement` (shared/policies/placement.py).
PLACEMENT_RULES = {
    "atlas": "atlas: largest DC first, consecutive stages",
    "round_robin": "round_robin: stages dealt over the DCs in spec order",
}


def plan_data(spec: ClusterSpec, fwd_ms_per_layer: float, bwd_ms_per_layer: float, source: str) -> dict[str, Any]:
    """What `bubbletea plan --json` prints: the same figures as `plan_report`, as one object."""
    pl = placement_of(spec)
    layers = layers_per_stage(spec)
    act = activation_bytes(spec)
    links = []
    for a, b in dict.fromkeys((a, b) for _, a, b in pl.hops()):
        link = LinkModel.from_params(spec.link(a, b), spec.wan.mode)
        links.append(
            {
                "src": a, "dst": b, "hops": sum(1 for _, x, y in pl.hops() if (x, y) == (a, b)),
                "gbps": link.bandwidth * 8 / 1e9, "latency_ms": link.latency * 1000,
                "per_transfer_cap_gbps": link.flow_cap * 8 / 1e9, "activation_alone_ms": link.alone_s(act) * 1000,
            }
        )  # fmt: skip
    analytic = {}
    for sharing in ("fair", "temporal", "fifo"):
        r = predict(spec, fwd_ms_per_layer, bwd_ms_per_layer, sharing=sharing)
        analytic[sharing] = {"iteration_ms": r.iteration_times[-1] * 1000, "bubble_fraction": r.bubble_fraction()}
    p, m = spec.parallelism.pp, spec.training.microbatches
    return {
        "cluster": spec.name,
        "datacenters": {dc.name: dc.gpus for dc in spec.datacenters},
        "parallelism": {"pp": p, "dp": spec.parallelism.dp, "tp": spec.parallelism.tp},
        "schedule": spec.training.schedule,
        "microbatches": m,
        "sharing": spec.wan.sharing,
        "placement": spec.parallelism.placement,
        "stages": [{"stage": k, "dc": dc, "layers": layers[k]} for k, dc in enumerate(pl.stage_dc)],
        "hops": [{"stage": k, "src": a, "dst": b} for k, a, b in pl.hops()],
        "activation_bytes": act,
        "links": links,
        "compute": {"source": source, "fwd_ms_per_layer": fwd_ms_per_layer, "bwd_ms_per_layer": bwd_ms_per_layer},
        "analytic": analytic,
        "compute_only_bubble_fraction": compute_bubble_fraction(p, m),
    }


def plan_report(spec: ClusterSpec, fwd_ms_per_layer: float, bwd_ms_per_layer: float, source: str) -> str:
    """The text `bubbletea plan` prints."""
    pl = placement_of(spec)
    lines = [
        f"cluster {spec.name}: " + ", ".join(f"{dc.name}={dc.gpus} GPUs" for dc in spec.datacenters),
        f"parallelism PP={spec.parallelism.pp} DP={spec.parallelism.dp} TP={spec.parallelism.tp}, "
        f"schedule {spec.training.schedule}, {spec.training.microbatches} microbatches, "
        f"WAN sharing {spec.wan.sharing}",
        "",
        f"placement ({PLACEMENT_RULES[spec.parallelism.placement]}):",
    ]
    layers = layers_per_stage(spec)
    for k, dc in enumerate(pl.stage_dc):
        lines.append(f"  stage {k}: {dc:<10} {layers[k]} layers, replicas 0..{spec.parallelism.dp - 1}")
    hops = pl.hops()
    lines.append(
        f"cross-DC hops ({len(hops)} of {len(pl.stage_dc) - 1}): "
        + (", ".join(f"stage {k}->{k + 1} ({a}->{b})" for k, a, b in hops) or "none")
    )
    act = activation_bytes(spec)
    per_link: dict[tuple[str, str], int] = {}
    for _, a, b in hops:
        per_link[(a, b)] = per_link.get((a, b), 0) + 1
    for (a, b), n in per_link.items():
        link = LinkModel.from_params(spec.link(a, b), spec.wan.mode)
        shared = f" ({n} hops share it)" if n > 1 else ""
        lines.append(
            f"  {a}->{b}{shared}: {bits_per_s(link.bandwidth * 8)}, {link.latency * 1000:.1f} ms one way, "
            f"per-transfer cap {bits_per_s(link.flow_cap * 8)}; one activation ({act / 1e6:.3f} MB) "
            f"alone takes {link.alone_s(act) * 1000:.2f} ms"
        )
    lines += [
        "",
        f"analytic model (compute: {source}; fwd {fwd_ms_per_layer:.3f} ms, bwd {bwd_ms_per_layer:.3f} ms "
        "per layer per microbatch):",
    ]
    p, m = spec.parallelism.pp, spec.training.microbatches
    for sharing in ("fair", "temporal", "fifo"):
        r = predict(spec, fwd_ms_per_layer, bwd_ms_per_layer, sharing=sharing)
        mark = "  <- spec" if sharing == spec.wan.sharing else ""
        lines.append(
            f"  {sharing:<9} iteration {r.iteration_times[-1] * 1000:9.2f} ms, "
            f"bubble fraction {r.bubble_fraction():.3f}{mark}"
        )
    lines.append(f"  compute-only bubble fraction (p-1)/(m+p-1) = {compute_bubble_fraction(p, m):.3f}")
    return "\n".join(lines)


def bits_per_s(bps: float) -> str:
    """A link's rate in the unit that shows it: the demo's 3.28 Mb/s is not "0.00 Gb/s"."""
    for unit, scale in (("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} b/s"
