"""The cluster spec's training sections: the model's shape, its split over stages, how it trains, the device."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.config.fields import DEVICE, HOST, Millis, Section


class ModelSpec(Section, frozen=True):
    """A small GPT (nanoGPT shape) with a byte-level tokenizer."""

    layers: Annotated[int, Meta(ge=1, le=256)] = 4
    d_model: Annotated[int, Meta(ge=8, le=16_384)] = 64
    heads: Annotated[int, Meta(ge=1, le=256)] = 4
    seq_len: Annotated[int, Meta(ge=2, le=65_536)] = 64
    vocab: Annotated[int, Meta(ge=256, le=1_000_000)] = 256
    seed: Annotated[int, Meta(ge=0)] = 0


class Parallelism(Section, frozen=True):
    pp: Annotated[int, Meta(ge=1, le=1024)] = 2
    dp: Annotated[int, Meta(ge=1, le=1024)] = 2
    tp: Annotated[int, Meta(ge=1, le=64)] = 1
    #: Which DC runs each stage: atlas = largest DC first, consecutive stages (few WAN hops);
    #: round_robin = stages dealt over the DCs in spec order (the naive baseline, most hops cross the WAN).
    placement: Literal["atlas", "round_robin"] = "atlas"
    #: How layers are cut into stages: layers = as evenly as the count allows (earlier stages take
    #: the extra ones); params = balance the parameters each stage computes with (12 d_model^2 per
    #: layer, vocab x d_model for the embedding on the first stage and for the head on the last),
    #: so a large vocabulary's stages get fewer layers.
    split: Literal["layers", "params"] = "layers"


#: `training.iterations` of a run that trains until it is stopped (a service, not a finite job).
UNTIL_STOPPED = "until_stopped"
#: The most iterations a spec (or its schedule's warm-up and decay) may name.
MAX_ITERATIONS = 10_000_000


class Training(Section, frozen=True):
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    microbatches: Annotated[int, Meta(ge=1, le=4096)] = 4
    microbatch_size: Annotated[int, Meta(ge=1, le=4096)] = 2
    #: A number of iterations, or "until_stopped": train until SIGTERM/Ctrl-C (what `bubbletea up`
    #: and compose do, so serving never runs out of bubbles).
    iterations: Annotated[int, Meta(ge=1, le=MAX_ITERATIONS)] | Literal["until_stopped"] = 10
    lr: Annotated[float, Meta(gt=0, le=10)] = 3e-4
    seed: Annotated[int, Meta(ge=0)] = 0
    #: Every worker checkpoints its stage (weights and optimizer state, in Redis) after every this
    #: many iterations, so a run survives a lost worker: it pauses, a replacement takes the slot and
    #: every worker resumes from the newest checkpoint all slots have. 0 = no checkpoints: a lost
    #: worker stops the run.
    checkpoint_every: Annotated[int, Meta(ge=0, le=1_000_000)] = 10
    #: How long the run waits for a lost worker's replacement before it gives up (the peers stop,
    #: naming the slot).
    recovery_timeout_s: Annotated[float, Meta(gt=0, le=86_400), HOST] = 60.0
    #: A local Hugging Face model directory to train (config.json; its safetensors, if any, are
    #: the starting weights, else it is initialised as its family does). None: the small GPT of the
    #: top-level `model` section trains. With a directory, `model`'s shape is read from it.
    model: str | None = None
    #: Local text or JSONL files to train on, tokenized with the model directory's tokenizer.json
    #: (needs `model`). None: the standard library's bytes (the small GPT's corpus).
    data: list[str] | None = None
    #: The learning rate: linear warm-up over `warmup_iters`, then a cosine decay to
    #: `lr * min_lr_ratio` at `decay_iters` (None: the run's iterations; a run that trains until
    #: stopped keeps `lr` after the warm-up), then flat. `constant`: `lr` after the warm-up.
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    warmup_iters: Annotated[int, Meta(ge=0, le=MAX_ITERATIONS)] = 0
    decay_iters: Annotated[int, Meta(ge=1, le=MAX_ITERATIONS)] | None = None
    min_lr_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.1
    #: Gradients are scaled so their global norm (over every stage's parameters) is at most this;
    #: 0 = no clipping.
    clip_grad_norm: Annotated[float, Meta(ge=0, le=1e6)] = 1.0
    #: auto: bf16 autocast for the forward on CUDA (the loss in float32), float32 on the CPU;
    #: fp32: float32 everywhere (e.g. to compare a GPU run with a CPU reference closely).
    precision: Literal["auto", "fp32"] = "auto"
    #: With `bubbletea train --save DIR`: write DIR after every this many iterations too (and at
    #: the end); 0 = at the end only.
    save_every: Annotated[int, Meta(ge=0, le=1_000_000)] = 0

    @property
    def recovers(self) -> bool:
        """Whether a lost worker is replaced and the run resumes (it needs checkpoints)."""
        return self.checkpoint_every > 0

    @property
    def until_stopped(self) -> bool:
        return self.iterations == UNTIL_STOPPED

    @property
    def iteration_limit(self) -> int | None:
        """The number of iterations to train, or None for a run that trains until stopped."""
        return None if isinstance(self.iterations, str) else self.iterations


class Device(Section, frozen=True):
    """The accelerator. `kind` picks where a worker really computes (`shared.model.devices`). With a
    profile, each operation *counts* for the profiled time: the worker runs the real computation,
    then pads to the profiled duration (reporting lag if the real computation is slower), so a small
    model on CPU can stand in for a large one on real GPUs."""

    #: Where training and prefill run: auto = the GPU of this worker's slot when torch sees CUDA,
    #: else the CPU; cpu = always the CPU; cuda = a GPU or the worker refuses to start.
    kind: Literal["auto", "cpu", "cuda"] = "auto"
    #: Forward time of one transformer block for one microbatch; None = use real compute time.
    fwd_ms_per_layer: Annotated[float, Meta(gt=0, le=3_600_000), DEVICE] | None = None
    #: Backward time per block per microbatch; None = 2 x forward (the usual ratio).
    bwd_ms_per_layer: Annotated[float, Meta(gt=0, le=3_600_000), DEVICE] | None = None
    #: Time of a stage's gradient all-reduce among its DP peers (inside one DC).
    allreduce_ms: Annotated[Millis, DEVICE] = 0.0
    #: Time of one optimizer step.
    step_ms: Annotated[Millis, DEVICE] = 0.0
    #: Accelerator memory; free memory is reported with each bubble.
    memory_gib: Annotated[float, Meta(gt=0, le=100_000)] = 80.0
    #: Prefill profile: one transformer block of one prompt of T tokens counts for
    #: prefill_ms_per_layer + T x prefill_us_per_token / 1000 ms. Both None = real compute time.
    prefill_ms_per_layer: Annotated[float, Meta(ge=0, le=3_600_000), DEVICE] | None = None
    prefill_us_per_token: Annotated[float, Meta(ge=0, le=3_600_000), DEVICE] | None = None
    #: The device's overheads in that profile: a block (or piece, `bubbletea.piece_tokens`) takes
    #: at least prefill_launch_us (the host's launch speed), and a finished request
    #: prefill_sync_us more (its first token read off the device). The simulator counts them too.
    prefill_launch_us: Annotated[float, Meta(ge=0, le=3_600_000), DEVICE] = 0.0
    prefill_sync_us: Annotated[float, Meta(ge=0, le=3_600_000), DEVICE] = 0.0
