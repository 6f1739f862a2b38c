"""The cluster spec: one YAML file loaded once into frozen, validated objects.

Every field, its default and its allowed range are documented in `docs/config.md`. A bad value
fails at load time with a `ConfigError` that names the field (as a path such as
``datacenters[1].gpus``) and says what is allowed. Services get these objects passed in; nothing
reads the file or the environment after start-up (see `shared.settings` for the environment).

Over 300 lines on purpose: the spec's one home, every section and its validation together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import msgspec.inspect as mi
import yaml
from msgspec import Meta

from shared.model.info import CheckpointError, info_from_config, read_config


class ConfigError(ValueError):
    """The spec (or an environment override) is invalid; the message names the field."""


# Reusable constrained types: msgspec reports a violation as e.g. "Expected `int` >= 1 - at `$.x`".
Name = Annotated[
    str, Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="lower-case letters, digits, '-' and '_', 1-63 chars")
]
Count = Annotated[int, Meta(ge=1, le=1_000_000)]
Millis = Annotated[float, Meta(ge=0, le=3_600_000)]

# Every duration (and rate) in the spec declares its clock (docs/config.md, "Clocks"); the time
# scale k (`shared.timescale.scale_spec`) reads these marks, so no field is stretched by a list
# kept elsewhere, and a test refuses a duration without one.
#: Device time: what the emulated hardware takes, and margins sized against its bubbles. At a time
#: scale k it lasts k times as long in real time.
DEVICE = Meta(extra={"clock": "device"})
#: A rate per unit of device time (a link's bandwidth): at a time scale k it is k times lower.
DEVICE_RATE = Meta(extra={"clock": "device-rate"})
#: Host time: this machine's own waits (processes, sockets, clients, memory). Never stretched.
HOST = Meta(extra={"clock": "host"})


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base: immutable, and a misspelt key is an error rather than a silently ignored value."""


class DataCenter(_Spec, frozen=True):
    name: Name
    gpus: Annotated[int, Meta(ge=1, le=1_000_000)]


class LinkParams(_Spec, frozen=True):
    """One directed WAN link. The per-flow TCP cap is connections * window / RTT."""

    latency_ms: Annotated[float, Meta(ge=0, le=10_000), DEVICE] = 40.0  # one-way
    bandwidth_gbps: Annotated[float, Meta(gt=0, le=100_000), DEVICE_RATE] = 10.0
    tcp_window_mib: Annotated[float, Meta(gt=0, le=4096)] = 6.0
    connections: Annotated[int, Meta(ge=1, le=1024)] = 4


class LinkOverride(_Spec, frozen=True):
    """Overrides the default link parameters between two DCs (both directions unless symmetric=false)."""

    src: Name
    dst: Name
    symmetric: bool = True
    latency_ms: Annotated[float, Meta(ge=0, le=10_000), DEVICE] | None = None
    bandwidth_gbps: Annotated[float, Meta(gt=0, le=100_000), DEVICE_RATE] | None = None
    tcp_window_mib: Annotated[float, Meta(gt=0, le=4096)] | None = None
    connections: Annotated[int, Meta(ge=1, le=1024)] | None = None


class Wan(_Spec, frozen=True):
    default: LinkParams = LinkParams()
    links: tuple[LinkOverride, ...] = ()
    #: fair = processor sharing; temporal = Atlas slot arbiter; fifo = naive one-at-a-time baseline.
    sharing: Literal["fair", "temporal", "fifo"] = "temporal"
    #: How cross-DC bytes meet the WAN (docs/config.md#wan-modes): `model` = real sockets on one
    #: machine, the receiver released when the broker's link model says; `kernel` = each DC a
    #: network namespace, links shaped in the kernel, the broker granting slots; `none` = a real
    #: network between hosts, nothing emulated, the broker granting slots.
    mode: Literal["model", "kernel", "none"] = "model"


class ModelSpec(_Spec, frozen=True):
    """A small GPT (nanoGPT shape) with a byte-level tokenizer."""

    layers: Annotated[int, Meta(ge=1, le=256)] = 4
    d_model: Annotated[int, Meta(ge=8, le=16_384)] = 64
    heads: Annotated[int, Meta(ge=1, le=256)] = 4
    seq_len: Annotated[int, Meta(ge=2, le=65_536)] = 64
    vocab: Annotated[int, Meta(ge=256, le=1_000_000)] = 256
    seed: Annotated[int, Meta(ge=0)] = 0


class Parallelism(_Spec, frozen=True):
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


class Training(_Spec, frozen=True):
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


class Device(_Spec, frozen=True):
    """The accelerator. `kind` picks where a worker really computes (`shared.devices`). With a
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


class BubbleTea(_Spec, frozen=True):
    enabled: bool = True
    #: Safety margin kept free at the end of every bubble so prefill never delays training.
    guard_ms: Annotated[Millis, DEVICE] = 2.0
    #: Expected time from bubble start to the batch running on the worker.
    dispatch_overhead_ms: Annotated[Millis, DEVICE] = 1.0
    max_batch_requests: Annotated[int, Meta(ge=1, le=4096)] = 32
    order: Literal["deadline", "arrival"] = "deadline"
    #: Work kept outstanding on a worker while its bubble is open, beyond the predicted budget if
    #: need be (0 = strictly the budget). Safe: prefill yields at the next layer boundary.
    keep_ahead_ms: Annotated[Millis, DEVICE] = 0.0
    #: At most this much work sent ahead for a worker's next bubble when one ends (0 = no staging).
    stage_ms: Annotated[Millis, DEVICE] = 1000.0
    #: How long a worker keeps such work for its next bubble before handing it back unrun (training
    #: paused or over). Keep it above the longest time between two of a worker's bubbles.
    hold_ms: Annotated[float, Meta(gt=0, le=3_600_000), DEVICE] = 1000.0
    #: Serving is declared stalled (`/ready` 503, new requests 503, queued ones failed) when every
    #: slot is held but no bubble was announced for this long. Keep it above the longest iteration.
    unready_after_s: Annotated[float, Meta(gt=0, le=86_400), DEVICE] = 10.0


#: `prefill.kv_budget_mb`'s default: a quarter of the default Redis maxmemory (1 GiB), e.g. 30 s of
#: 256-token prompts at 16 req/s for the demo's 4-layer, 64-wide model (0.5 MiB a cache).
DEFAULT_KV_BUDGET_MB = 256


class Prefill(_Spec, frozen=True):
    #: The model id clients name (`model` in the OpenAI API; listed by GET /v1/models).
    model_name: Annotated[str, Meta(min_length=1, max_length=128)] = "bubbletea-gpt"
    #: The nanoGPT's shape when no Hugging Face directory is served (seeded, or a state_dict file).
    model: ModelSpec = ModelSpec()
    #: A local Hugging Face model directory (config.json, *.safetensors, tokenizer.json: gpt2,
    #: llama, mistral or qwen2; its config.json gives the shape and `model` is not used), or a
    #: state_dict file of the nanoGPT of shape `model`; None = `model` seeded with `model.seed`.
    #: Nothing is ever downloaded (docs/config.md, "Models").
    checkpoint: str | None = None
    max_prompt_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] = 512
    #: Beyond this many queued requests the HTTP front door answers 429 with Retry-After.
    max_queue_depth: Annotated[int, Meta(ge=1, le=10_000_000)] = 10_000
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 1 << 20
    request_timeout_s: Annotated[float, Meta(gt=0, le=86_400), DEVICE] = 60.0
    #: How long a finished prefill's KV cache is kept for a decode service (0 = not kept).
    kv_ttl_s: Annotated[int, Meta(ge=0, le=86_400), HOST] = 30
    #: Where it is kept: `plane` = in the memory of the worker that computed it, fetched over the
    #: data plane (Redis holds only the handle); `redis` = as a safetensors string in Redis, which
    #: any Redis client can GET (docs/api.md, "The KV cache").
    kv_store: Literal["plane", "redis"] = "plane"
    #: Bytes of KV caches kept at once (`plane`: per worker, until freed or expired; `redis`: in
    #: Redis, counted as stored until their TTL): past it a finished prefill still answers, but its
    #: KV cache is not kept (the handle says why).
    kv_budget_mb: Annotated[int, Meta(ge=1, le=1_048_576)] = DEFAULT_KV_BUDGET_MB


class Decode(_Spec, frozen=True):
    """The decoder service: whole completions after the bubbles' prefill (`max_tokens` > 1)."""

    #: With false, the front door serves prefill only (max_tokens must be 1). `bubbletea up
    #: --decode` and BUBBLETEA_DECODE=on turn it on (and up starts the decoder).
    enabled: bool = False
    #: The largest `max_tokens` a request may ask for.
    max_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] = 256
    #: Completions one decoder generates at once (each in its own thread, token by token).
    concurrency: Annotated[int, Meta(ge=1, le=1024)] = 4
    #: A chunk of tokens goes to the client at least this often (and at every stop), so a
    #: streamed completion arrives token by token without a Redis round trip per token.
    chunk_ms: Annotated[float, Meta(ge=0, le=10_000), HOST] = 20.0
    #: Who continues a prefilled prompt: "builtin" (the decoder service, `services/decoder`) or
    #: "vllm" (a vLLM server at `vllm_url` with the BubbleTea KV connector; docs/vllm.md).
    engine: Literal["builtin", "vllm"] = "builtin"
    #: The vLLM server's base URL (engine "vllm"), e.g. http://127.0.0.1:8100.
    vllm_url: str = ""
    #: The model name to ask vLLM for ("" = the first of its /v1/models).
    vllm_model: str = ""


class Http(_Spec, frozen=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65_535)] = 8000  # 0 = any free port


class BusConfig(_Spec, frozen=True):
    """Delivery knobs of the Redis Streams bus (see docs/architecture.md, "The bus")."""

    #: After this many failed deliveries a message goes to the dead-letter stream.
    max_deliveries: Annotated[int, Meta(ge=1, le=1000)] = 5
    #: A pending entry idle this long is assumed abandoned (its consumer died) and is reclaimed.
    claim_idle_ms: Annotated[int, Meta(ge=10, le=3_600_000), HOST] = 5_000
    #: Blocking reads wait at most this long; kept well under the socket timeout.
    block_ms: Annotated[int, Meta(ge=1, le=60_000), HOST] = 1_000
    #: Handlers a consumer runs at once.
    concurrency: Annotated[int, Meta(ge=1, le=10_000)] = 64
    #: Soft bound on a work stream's length: fully-acked entries are trimmed; unread ones are kept
    #: and a warning says how far over the bound the backlog is.
    max_stream_len: Annotated[int, Meta(ge=100, le=100_000_000)] = 100_000
    #: In-flight handlers get this long to finish on shutdown before they are cancelled.
    drain_grace_s: Annotated[float, Meta(ge=0, le=600), HOST] = 5.0


class ClusterSpec(_Spec, frozen=True, kw_only=True):
    name: Name = "bubbletea"
    datacenters: Annotated[tuple[DataCenter, ...], Meta(min_length=1)]
    wan: Wan = Wan()
    model: ModelSpec = ModelSpec()
    parallelism: Parallelism = Parallelism()
    training: Training = Training()
    device: Device = Device()
    bubbletea: BubbleTea = BubbleTea()
    prefill: Prefill = Prefill()
    decode: Decode = Decode()
    http: Http = Http()
    bus: BusConfig = BusConfig()

    def link(self, src: str, dst: str) -> LinkParams:
        """Effective parameters of the directed link src -> dst (default plus overrides)."""
        params = self.wan.default
        for o in self.wan.links:
            if (o.src, o.dst) == (src, dst) or (o.symmetric and (o.dst, o.src) == (src, dst)):
                changes = {f: getattr(o, f) for f in LinkParams.__struct_fields__ if getattr(o, f) is not None}
                params = msgspec.structs.replace(params, **changes)
        return params


def check_decode(spec: ClusterSpec) -> None:
    """The decode section against the prefill section (also after environment overrides)."""
    d, p = spec.decode, spec.prefill
    if d.engine != "vllm":
        return
    if not d.vllm_url.startswith(("http://", "https://")):
        raise ConfigError(f"decode.vllm_url: engine vllm needs the vLLM server's http:// URL, got {d.vllm_url!r}")
    if p.kv_store != "plane" or p.kv_ttl_s <= 0:
        raise ConfigError(
            "decode.engine: vllm loads KV caches from the workers that hold them: it needs prefill.kv_store: "
            f"plane and prefill.kv_ttl_s > 0 (got {p.kv_store!r} and {p.kv_ttl_s})"
        )


def _check_semantics(spec: ClusterSpec) -> None:
    """Rules that span fields; each error names the field it is about."""
    names = [dc.name for dc in spec.datacenters]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"datacenters[{i}].name: duplicate datacenter name {name!r}")
    for i, o in enumerate(spec.wan.links):
        for end in ("src", "dst"):
            if getattr(o, end) not in names:
                raise ConfigError(
                    f"wan.links[{i}].{end}: unknown datacenter {getattr(o, end)!r} (known: {', '.join(names)})"
                )
        if o.src == o.dst:
            raise ConfigError(f"wan.links[{i}]: src and dst are both {o.src!r}; a WAN link joins two DCs")
    check_decode(spec)
    tr = spec.training
    small_gpts = [("prefill.model", spec.prefill.model)] + ([] if tr.model else [("model", spec.model)])
    for path, m in small_gpts:
        if m.d_model % m.heads:
            raise ConfigError(f"{path}.d_model: must be a multiple of {path}.heads ({m.heads}); got {m.d_model}")
    if tr.data is not None and tr.model is None:
        raise ConfigError(
            "training.data: needs training.model (a Hugging Face directory and its tokenizer); "
            "the small GPT trains on the standard library's bytes"
        )
    if tr.data is not None and not tr.data:
        raise ConfigError("training.data: is empty; expected a list of local text or JSONL files")
    if spec.parallelism.pp > spec.model.layers:
        layers = f"training.model's {spec.model.layers} layers" if tr.model else f"model.layers ({spec.model.layers})"
        raise ConfigError(
            f"parallelism.pp: {spec.parallelism.pp} stages would leave a stage without a layer: at most {layers}"
        )


_PATH = re.compile(r" - at `\$\.?(.*)`$")


def _allowed(path: str) -> str:
    """Describe what the field at `path` (e.g. ``datacenters[0].gpus``) accepts, from its type."""
    t: mi.Type = mi.type_info(ClusterSpec)
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        while isinstance(t, mi.UnionType):  # `X | None`: describe X
            t = next(a for a in t.types if not isinstance(a, mi.NoneType))
        while isinstance(t, (mi.VarTupleType, mi.ListType)):
            t = t.item_type
        fields = {f.name: f.type for f in t.fields} if isinstance(t, mi.StructType) else {}
        if part not in fields:
            return ""
        t = fields[part]
    while isinstance(t, mi.UnionType):
        t = next(a for a in t.types if not isinstance(a, mi.NoneType))
    if isinstance(t, mi.LiteralType):
        return "allowed: " + ", ".join(map(str, t.values))
    if isinstance(t, (mi.IntType, mi.FloatType)):
        lo = f">= {t.ge}" if t.ge is not None else f"> {t.gt}" if t.gt is not None else ""
        hi = f"<= {t.le}" if t.le is not None else f"< {t.lt}" if t.lt is not None else ""
        return "allowed: " + " and ".join(x for x in (lo, hi) if x) if lo or hi else ""
    return ""


def parse_spec(data: object, *, source: str = "<spec>") -> ClusterSpec:
    """Validate already-parsed YAML/JSON data into a `ClusterSpec`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the spec must be a mapping of sections, got {type(data).__name__}")
    try:
        spec = msgspec.convert(data, ClusterSpec)
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `int` >= 1 - at `$.datacenters[0].gpus`"; lead with the field.
        text = str(exc)
        m = _PATH.search(text)
        field = m.group(1) if m and m.group(1) else "(top level)"
        allowed = _allowed(field) if m else ""
        raise ConfigError(f"{source}: {field}: {_PATH.sub('', text)}" + (f" ({allowed})" if allowed else "")) from None
    try:
        spec = _with_training_model(spec)
        _check_semantics(spec)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return spec


def _with_training_model(spec: ClusterSpec) -> ClusterSpec:
    """With `training.model`, the `model` section takes that directory's shape (layers, d_model,
    heads, vocab), so the stage split, the activation size and the device profile describe the model
    that trains; `model.seq_len` stays the training sequence length (at most the model's positions)."""
    if spec.training.model is None:
        return spec
    try:
        info = info_from_config(read_config(spec.training.model))
    except CheckpointError as exc:
        hint = "" if Path(spec.training.model).exists() else f"; `bubbletea init-model {spec.training.model}` makes one"
        raise ConfigError(f"training.model: {exc}{hint}") from None
    if spec.model.seq_len > info.max_model_len:
        raise ConfigError(
            f"model.seq_len: {spec.model.seq_len} is longer than training.model's {info.max_model_len} positions"
        )
    model = msgspec.structs.replace(
        spec.model, layers=info.layers, d_model=info.d_model, heads=info.heads, vocab=info.vocab
    )
    return msgspec.structs.replace(spec, model=model)


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read cluster spec {p}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_spec(data, source=str(p))
