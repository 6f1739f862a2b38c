"""A cluster spec read as the simulator's inputs: the training pipeline, the served model, the load.

Training takes the spec's device profile (`device.fwd_ms_per_layer`, ...), or `--fwd-ms` when it
has none, exactly as `bubbletea plan` does; prefill takes the spec's prefill profile
(`device.prefill_ms_per_layer`, `prefill_us_per_token`), or `DEFAULT_PREFILL` when it has none
(said in the output). Everything a bad spec or option can get wrong is a `SimError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.model_info import CheckpointError, ModelInfo
from shared.config.spec import ClusterSpec
from shared.config.timescale import profile_ms
from shared.model.shape import max_prompt_tokens, model_info
from shared.policies.pipeline_model import PipelineInputs
from shared.policies.pipeline_plan import layers_per_stage, model_inputs, placement_of
from shared.policies.prefill_cost import PrefillProfile
from shared.policies.prompt_placement import mode_of
from sim.serving_config import ServingConfig

#: The prefill profile of a spec that has none: the demo's (0.25 ms + 8 us per token per layer).
DEFAULT_PREFILL = PrefillProfile(fixed_s=0.25e-3, per_token_s=8e-6)
#: Forward ms per layer per microbatch of a spec with no device profile (as `bubbletea plan`).
DEFAULT_FWD_MS = 10.0
#: One hop over the bus (Redis Streams, publish to a running handler: p50 ~0.3 ms, docs/architecture.md).
BUS_S = 0.3e-3
#: Bytes per parameter a training stage holds: float32 weights, gradients and AdamW's two moments.
TRAIN_STATE_BYTES_PER_PARAM = 16


class SimError(ValueError):
    """The simulation cannot run as asked; the message is one sentence naming the problem."""


@dataclass(frozen=True)
class SimSetup:
    spec: ClusterSpec
    pipeline: PipelineInputs
    serving: ServingConfig
    fwd_ms_per_layer: float
    bwd_ms_per_layer: float
    training_profile: str  # where the training times come from
    prefill_profile: str  # where the prefill times come from
    model: ModelInfo

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the front door accepts (`shared.model.shape.max_prompt_tokens`)."""
        return max_prompt_tokens(self.spec.prefill, self.model)


def build(spec: ClusterSpec, *, fwd_ms: float = DEFAULT_FWD_MS, bus_s: float = BUS_S) -> SimSetup:
    prof = profile_ms(spec)
    if prof is not None:
        fwd, bwd, source = prof[0], prof[1], "device profile"
    else:
        if not fwd_ms > 0:
            raise SimError(f"--fwd-ms must be > 0, got {fwd_ms}")
        fwd, bwd, source = fwd_ms, 2 * fwd_ms, f"no device profile in the spec: {fwd_ms:g} ms forward per layer"
    pipeline = model_inputs(spec, fwd, bwd)
    try:
        info = model_info(spec.prefill)
    except (CheckpointError, OSError, ValueError) as exc:
        raise SimError(f"prefill.checkpoint: the served model's shape cannot be read ({exc})") from None
    prefill = PrefillProfile.of_spec(spec)  # with its overheads (launch, sync) and pieces
    prefill_source = "device profile"
    if prefill is None:
        prefill = DEFAULT_PREFILL
        prefill_source = "no prefill profile in the spec: 0.25 ms + 8 us per token per layer assumed"
    if prefill.block_s(1) <= 0:
        raise SimError("device.prefill_ms_per_layer and prefill_us_per_token: a prefill block must take some time")
    bt = spec.bubbletea
    stage_dc = placement_of(spec).stage_dc
    serving = ServingConfig(
        workers=tuple(f"r{d}s{k}" for d in range(spec.parallelism.dp) for k in range(spec.parallelism.pp)),
        datacenters=tuple(stage_dc[k] for _ in range(spec.parallelism.dp) for k in range(spec.parallelism.pp)),
        layers=info.layers,
        bubbletea=bt,
        profile=prefill,
        free_memory=free_memory(spec, info),
        kv_bytes=info.kv_bytes,
        timeout_s=spec.prefill.request_timeout_s,
        max_queue=spec.prefill.max_queue_depth,
        bus_s=bus_s,
        objective_s=spec.prefill.ttft_objective_ms / 1000 if spec.prefill.ttft_objective_ms else None,
        placement=mode_of(spec.prefill.placement, spec.decode.enabled),
    )
    return SimSetup(spec, pipeline, serving, fwd, bwd, source, prefill_source, info)


def free_memory(spec: ClusterSpec, served: ModelInfo) -> int:
    """What a worker reports free with each bubble: device memory minus the largest training
    stage's state and the served model's float32 weights (approximate: blocks of 12 d^2, the
    embeddings and head on the end stages)."""
    m = spec.model
    blocks = max(layers_per_stage(spec)) * 12 * m.d_model**2
    ends = (m.vocab + m.seq_len) * m.d_model + m.vocab * m.d_model  # with pp == 1 one stage has both
    train = TRAIN_STATE_BYTES_PER_PARAM * (blocks + ends) // max(1, spec.parallelism.tp)
    guest = 4 * (served.layers * 12 * served.d_model**2 + (served.vocab + served.max_model_len) * served.d_model)
    return max(0, int(spec.device.memory_gib * (1 << 30)) - train - guest)
