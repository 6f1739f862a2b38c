"""bench/paper.py's cases: one config simulated (`Case`), and DP across DCs (simulated pipelines + WAN all-reduce)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.config.spec import ClusterSpec, parse_spec
from shared.policies.pipeline_plan import ACT_ELEMENT_BYTES
from shared.policies.wan import LinkModel
from sim.output import figures
from sim.run import SimOptions, simulate

#: Prompt length of the prefill load (tokens): long prompts keep the request count, and so the
#: simulation's cost, small while the bubbles last seconds.
INPUT_LEN = 2048
#: The load as a share of what the bubbles could hold (sim.run.capacity_rate).
LOAD = 1.0


@dataclass(frozen=True)
class Case:
    """One simulated (or simulated + analytic) configuration."""

    name: str
    label: str
    iteration_s: float
    utilization: float  # training only (fwd, bwd, all-reduce, step) over the steady window
    utilization_on: float | None = None  # training + prefill, BubbleTea on
    bubble_fraction: float | None = None
    slowdown_pct: float | None = None


def load_raw(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def spec_of(raw: dict[str, Any]) -> ClusterSpec:
    return parse_spec(raw, source=str(raw.get("name")))


def with_wan(raw: dict[str, Any], **link: float) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    out["wan"]["default"].update(link)
    return out


def run(raw: dict[str, Any], iterations: int, bubbletea: bool) -> dict[str, Any]:
    opts = SimOptions(iterations=iterations, input_len=INPUT_LEN, load=LOAD, seed=0, bubbletea=bubbletea)
    return figures(simulate(spec_of(raw), opts))


def pp_case(name: str, label: str, raw: dict[str, Any], iterations: int, bubbletea: bool = False) -> Case:
    f = run(raw, iterations, bubbletea)
    if not bubbletea:
        return Case(name, label, f["iteration_ms_off"] / 1000, f["utilization_off"], None, f["bubble_fraction"])
    return Case(
        name,
        label,
        f["iteration_ms"] / 1000,
        f["utilization_off"],
        f["utilization_on"],
        f["bubble_fraction"],
        f["train_slowdown_pct"],
    )


# --- data parallelism across DCs: simulated in-DC pipeline + analytic WAN all-reduce -----------------


def param_count(spec: ClusterSpec) -> int:
    """GPT parameters: 12 d^2 per block (attention 4 d^2, MLP 8 d^2), token and position
    embeddings and an untied output head (biases and norms left out)."""
    m = spec.model
    return 12 * m.layers * m.d_model**2 + (2 * m.vocab + m.seq_len) * m.d_model


def wan_allreduce_s(spec: ClusterSpec, n: int) -> float:
    """A ring all-reduce of the whole model's gradients among n DCs over the WAN:
    each DC sends 2 (n-1)/n x S bytes on its link to the next DC, at the link's per-transfer rate
    (min(bandwidth, connections x window / RTT), the spec's connections), plus 2 (n-1) one-way
    latencies (the ring's steps). S = parameters x ACT_ELEMENT_BYTES (float32, as activations)."""
    if n < 2:
        return 0.0
    link = LinkModel.from_params(spec.wan.default)
    grad_bytes = param_count(spec) * ACT_ELEMENT_BYTES
    return 2 * (n - 1) / n * grad_bytes / link.flow_cap + 2 * (n - 1) * link.latency


def local_raw(raw: dict[str, Any], replicas: int, microbatches: int) -> dict[str, Any]:
    """The same job's pipelines in one DC: `replicas` whole pipelines of `microbatches` each, no WAN."""
    out = copy.deepcopy(raw)
    par = out["parallelism"]
    out["datacenters"] = [{"name": "local", "gpus": par["pp"] * par["tp"] * replicas}]
    par["dp"] = replicas
    out["training"]["microbatches"] = microbatches
    out["name"] = f"{raw['name']}-local"
    return out


def dp_cases(raw: dict[str, Any], iterations: int) -> tuple[Case, Case, Case]:
    """(no WAN at all, DP across DCs serial, DP across DCs with the all-reduce fully overlapped).

    Every DC holds gpus // (PP x TP) whole pipeline replicas, R in all, and the global batch (DP x
    microbatches of the PP-across-DCs job) is split evenly over them (rounded up). The pipelines
    inside the fullest DC are simulated (every DC waits for it at the all-reduce), then the WAN ring
    all-reduce among the DCs that hold a replica is added. GPUs left out of a whole pipeline idle,
    and utilization counts them (over every GPU of the cluster)."""
    spec = spec_of(raw)
    par = spec.parallelism
    per_replica = par.pp * par.tp
    local = [dc.gpus // per_replica for dc in spec.datacenters]
    replicas = sum(local)
    if replicas < 1:
        raise SystemExit(f"{spec.name}: no DC holds a whole pipeline of {per_replica} GPUs")
    batch = par.dp * spec.training.microbatches
    ideal_f = run(local_raw(raw, par.dp, spec.training.microbatches), iterations, bubbletea=False)
    ideal = Case(
        "no_wan", "same job in one DC (no WAN)", ideal_f["iteration_ms_off"] / 1000, ideal_f["utilization_off"]
    )
    f = run(local_raw(raw, max(local), math.ceil(batch / replicas)), iterations, bubbletea=False)
    t0 = f["iteration_ms_off"] / 1000
    u0 = f["utilization_off"] * replicas * per_replica / sum(dc.gpus for dc in spec.datacenters)
    t_wan = wan_allreduce_s(spec, sum(1 for n in local if n > 0))
    serial = t0 + t_wan
    hidden = max(t0, t_wan)
    return (
        ideal,
        Case("dp", "DP across DCs (ring all-reduce over the WAN)", serial, u0 * t0 / serial),
        Case("dp_overlap", "DP across DCs, all-reduce hidden behind compute", hidden, u0 * t0 / hidden),
    )
