"""The cluster spec read as the analytic pipeline model's inputs, and the model's predictions.

Placement, activation size, layers and compute time per stage, the device profile, and `predict`
(the model run on those inputs). The stage workers use it for their first bubble predictions;
`bubbletea plan` (bubbletea/plan.py) and the benchmarks print what it predicts.

Tested by: tests/unit/test_pipeline_model.py, tests/unit/test_timescale.py, tests/unit/test_sim_training.py.
"""

from __future__ import annotations

from shared.config.model_info import read_config, ties_embeddings
from shared.config.spec import ClusterSpec
from shared.model.shape import stage_layer_ranges
from shared.policies.pipeline_model import PipelineInputs, PipelineResult
from shared.policies.pipeline_run import simulate
from shared.policies.placement import Placement, place, round_robin
from shared.policies.walk import has_step_collectives
from shared.policies.wan import LinkModel

#: Bytes per activation element on the wire (float32).
ACT_ELEMENT_BYTES = 4


def placement_of(spec: ClusterSpec) -> Placement:
    """The spec's stage placement, by `parallelism.placement`; an infeasible spec raises `PlacementError`."""
    par = spec.parallelism
    dcs = [(dc.name, dc.gpus) for dc in spec.datacenters]
    match par.placement:
        case "atlas":
            return place(dcs, par.pp, par.dp, par.tp)
        case "round_robin":
            return round_robin(dcs, par.pp, par.dp, par.tp)


def activation_bytes(spec: ClusterSpec) -> int:
    """Bytes of one microbatch's activation (and of its gradient) between two stages."""
    return spec.training.microbatch_size * spec.model.seq_len * spec.model.d_model * ACT_ELEMENT_BYTES


def layers_per_stage(spec: ClusterSpec) -> list[int]:
    return [b - a for a, b in stage_layer_ranges(spec)]


def stage_times(spec: ClusterSpec, fwd_ms_per_layer: float, bwd_ms_per_layer: float) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per microbatch for each stage."""
    layers = layers_per_stage(spec)
    return [n * fwd_ms_per_layer / 1000 for n in layers], [n * bwd_ms_per_layer / 1000 for n in layers]


def step_collectives(spec: ClusterSpec) -> bool:
    """Whether a live step of this spec waits for the pipeline's cross-stage collectives (the
    global gradient norm, a tied embedding split across stages): `walk.has_step_collectives`."""
    model = spec.training.model
    tied = model is not None and ties_embeddings(read_config(model))
    return has_step_collectives(spec.parallelism.pp, spec.training.clip_grad_norm, tied)


def model_inputs(
    spec: ClusterSpec, fwd_ms_per_layer: float, bwd_ms_per_layer: float, sharing: str | None = None
) -> PipelineInputs:
    pl = placement_of(spec)
    names = [dc.name for dc in spec.datacenters]
    mode = spec.wan.mode  # the link as this WAN mode realises it (headers, slot protocol: LinkModel)
    links = {(a, b): LinkModel.from_params(spec.link(a, b), mode) for a in names for b in names if a != b}
    fwd, bwd = stage_times(spec, fwd_ms_per_layer, bwd_ms_per_layer)
    return PipelineInputs(
        stages=spec.parallelism.pp,
        dp=spec.parallelism.dp,
        microbatches=spec.training.microbatches,
        schedule=spec.training.schedule,
        stage_dc=pl.stage_dc,
        fwd_s=tuple(fwd),
        bwd_s=tuple(bwd),
        act_bytes=activation_bytes(spec),
        links=links,
        sharing=sharing or spec.wan.sharing,
        allreduce_s=(spec.device.allreduce_ms / 1000,) * spec.parallelism.pp,
        step_s=spec.device.step_ms / 1000,
        # the live step sums the global norm and a tied embedding across stages first
        step_collectives=step_collectives(spec),
    )


def predict(
    spec: ClusterSpec,
    fwd_ms_per_layer: float,
    bwd_ms_per_layer: float,
    *,
    iterations: int = 3,
    sharing: str | None = None,
) -> PipelineResult:
    return simulate(model_inputs(spec, fwd_ms_per_layer, bwd_ms_per_layer, sharing), iterations)


def dispatch_dc(spec: ClusterSpec, stage: int) -> str | None:
    """The datacenter whose dispatcher serves stage `stage`'s workers (its bubbles, batches and
    reports): the stage's own with `bubbletea.dispatch: per_dc`, else None (the run's one)."""
    return placement_of(spec).stage_dc[stage] if spec.bubbletea.dispatch == "per_dc" else None


def dispatch_dcs(spec: ClusterSpec) -> list[str | None]:
    """The run's dispatchers, by what each serves: [None] (one for the run), or each datacenter that
    holds a stage, in stage order (a datacenter without a stage has no bubbles to fill)."""
    if spec.bubbletea.dispatch != "per_dc":
        return [None]
    return list(dict.fromkeys(placement_of(spec).stage_dc))


def stages_of(spec: ClusterSpec, dc: str | None) -> list[int]:
    """The stages whose workers `dc`'s dispatcher serves (None: every stage)."""
    return [k for k in range(spec.parallelism.pp) if dispatch_dc(spec, k) == dc or dc is None]
