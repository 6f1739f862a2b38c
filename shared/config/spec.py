"""The cluster spec: one YAML file loaded once into frozen, validated objects.

Every field, its default and its allowed range are documented in `docs/config.md`. A bad value
fails at load time with a `ConfigError` that names the field (as a path such as
``datacenters[1].gpus``) and says what is allowed. Services get these objects passed in; nothing
reads the file or the environment after start-up (see `shared.config.settings` for the environment).

Here: the spec itself (`ClusterSpec`), its WAN, serving and bus sections, and loading with the
checks that span sections. The training sections (model, parallelism, training, device) are in
`shared.config.training`; the base, field types and clock marks every section uses in `shared.config.fields`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml
from msgspec import Meta

from shared.config.deprecated import deprecated_fields
from shared.config.fields import DEVICE, DEVICE_RATE, HOST, Millis, Name, Section
from shared.config.messages import validation_message
from shared.config.model_info import CheckpointError, info_from_config, read_config
from shared.config.training import Device, ModelSpec, Parallelism, Training

log = logging.getLogger(__name__)  # the standard logger: the config package sits below `shared.runtime`


class ConfigError(ValueError):
    """The spec (or an environment override) is invalid; the message names the field."""


class DataCenter(Section, frozen=True):
    name: Name
    gpus: Annotated[int, Meta(ge=1, le=1_000_000)]


class LinkParams(Section, frozen=True):
    """One directed WAN link. The per-flow TCP cap is connections * window / RTT."""

    latency_ms: Annotated[float, Meta(ge=0, le=10_000), DEVICE] = 40.0  # one-way
    bandwidth_gbps: Annotated[float, Meta(gt=0, le=100_000), DEVICE_RATE] = 10.0
    tcp_window_mib: Annotated[float, Meta(gt=0, le=4096)] = 6.0
    connections: Annotated[int, Meta(ge=1, le=1024)] = 4


class LinkOverride(Section, frozen=True):
    """Overrides the default link parameters between two DCs (both directions unless symmetric=false)."""

    src: Name
    dst: Name
    symmetric: bool = True
    latency_ms: Annotated[float, Meta(ge=0, le=10_000), DEVICE] | None = None
    bandwidth_gbps: Annotated[float, Meta(gt=0, le=100_000), DEVICE_RATE] | None = None
    tcp_window_mib: Annotated[float, Meta(gt=0, le=4096)] | None = None
    connections: Annotated[int, Meta(ge=1, le=1024)] | None = None


class Wan(Section, frozen=True):
    default: LinkParams = LinkParams()
    links: tuple[LinkOverride, ...] = ()
    #: fair = processor sharing; temporal = Atlas slot arbiter; fifo = naive one-at-a-time baseline.
    sharing: Literal["fair", "temporal", "fifo"] = "temporal"
    #: How cross-DC bytes meet the WAN (docs/config.md#wan-modes): `model` = real sockets on one
    #: machine, the receiver released when the broker's link model says; `kernel` = each DC a
    #: network namespace, links shaped in the kernel, the broker granting slots; `none` = a real
    #: network between hosts, nothing emulated, the broker granting slots.
    mode: Literal["model", "kernel", "none"] = "model"


class BubbleTea(Section, frozen=True):
    enabled: bool = True
    max_batch_requests: Annotated[int, Meta(ge=1, le=4096)] = 32
    order: Literal["deadline", "arrival"] = "deadline"
    #: Prefill work kept queued on every worker ahead of its bubbles (its credit), in its typical
    #: bubbles (the mean of its recent ones): a bubble starts with its work already there.
    credit_bubbles: Annotated[float, Meta(gt=0, le=100)] = 1.5
    #: At most this much work queued on one worker (requests held there are not available to
    #: another worker's bubble).
    max_credit_ms: Annotated[float, Meta(gt=0, le=3_600_000), DEVICE] = 1000.0
    #: How long a worker keeps queued work no bubble took before handing it back unrun (training
    #: paused or over). Keep it above the longest time between two of a worker's bubbles.
    hold_ms: Annotated[float, Meta(gt=0, le=3_600_000), DEVICE] = 1000.0
    #: Tokens of one prefill piece within a layer: a long prompt's layer runs in pieces of this
    #: many tokens, so training's input waits for at most one piece. 0: automatic (256 on a GPU,
    #: whole layers on a CPU: `shared.policies.fill.piece_tokens`).
    piece_tokens: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    #: Replay prefill blocks from CUDA graphs where shapes allow (a block with no earlier pieces,
    #: padded to a token bucket: `shared.model.graphs`). On a GPU only; off by default until it
    #: measures better on the device at hand (`bench/prefill_graphs.py`).
    cuda_graphs: bool = False
    #: Serving is declared stalled (`/ready` 503, new requests 503, queued ones failed) when every
    #: slot is held but no bubble was announced for this long. Keep it above the longest iteration.
    unready_after_s: Annotated[float, Meta(gt=0, le=86_400), DEVICE] = 10.0
    #: How many dispatchers serve the run: `one` for every worker and one request queue, or
    #: `per_dc`, one for each datacenter that holds stages (its workers' bubbles, credit and
    #: request queue; the front door routes each request to one: `shared.policies.dc_routing`).
    dispatch: Literal["one", "per_dc"] = "one"
    # No longer used (accepted so older specs load; `deprecated_fields` names them): a worker fills
    # a bubble until its training input arrives, from work queued before the bubble opened, so
    # neither a margin at the bubble's end nor a dispatch delay at its start is budgeted any more.
    guard_ms: Annotated[Millis, DEVICE] = 0.0
    dispatch_overhead_ms: Annotated[Millis, DEVICE] = 0.0
    keep_ahead_ms: Annotated[Millis, DEVICE] = 0.0
    stage_ms: Annotated[Millis, DEVICE] = 0.0


#: `prefill.kv_budget_mb`'s default: a quarter of the default Redis maxmemory (1 GiB), e.g. 30 s of
#: 256-token prompts at 16 req/s for the demo's 4-layer, 64-wide model (0.5 MiB a cache).
DEFAULT_KV_BUDGET_MB = 256


class Prefill(Section, frozen=True):
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
    #: The TTFT objective a request is served within unless it names its own (null: none; `up`,
    #: compose and the deploy scripts state 500 ms): docs/vllm.md, "Where a prompt is computed".
    ttft_objective_ms: Annotated[float, Meta(gt=0, le=86_400_000), DEVICE] | None = None
    #: Where prompts are computed: bubbles, decoder or auto (unset: auto where decode is enabled).
    placement: Literal["bubbles", "auto", "decoder"] | None = None
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


class Decode(Section, frozen=True):
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
    vllm_url: str = ""  # the vLLM server's base URL (engine "vllm"), e.g. http://127.0.0.1:8100
    vllm_model: str = ""  # the model name to ask vLLM for ("" = the first of its /v1/models)


class Http(Section, frozen=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65_535)] = 8000  # 0 = any free port


class BusConfig(Section, frozen=True):
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


class ClusterSpec(Section, frozen=True, kw_only=True):
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
        return  # the built-in decoder continues a prefill and computes a prompt, from either store
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


def parse_spec(data: object, *, source: str = "<spec>") -> ClusterSpec:
    """Validate already-parsed YAML/JSON data into a `ClusterSpec`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the spec must be a mapping of sections, got {type(data).__name__}")
    try:
        spec = msgspec.convert(data, ClusterSpec)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {validation_message(ClusterSpec, str(exc))}") from None
    try:
        spec = _with_training_model(spec)
        _check_semantics(spec)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    for line in deprecated_fields(data):
        log.warning(f"{source}: {line}")
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
        hint = (
            ""
            if Path(spec.training.model).exists()
            else f"; `bubbletea init-model {spec.training.model}` makes one (add --weights to serve it too)"
        )
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
        data = _load_yaml(text, str(p))
    except DuplicateKeyError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    except yaml.MarkedYAMLError as exc:  # one line: where, and what the parser expected
        mark = exc.problem_mark or exc.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        what = "; ".join(x for x in (exc.context, exc.problem) if x)
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    resolved = resolve_paths(data, p.parent)
    try:
        return parse_spec(data, source=str(p))
    except ConfigError as exc:
        if any(path in str(exc) for path in resolved):
            raise ConfigError(f"{exc} (a relative path in a spec is read from the spec's folder, {p.parent})") from None
        raise


#: The spec's fields that name files, as (section, field): a relative one is read from the spec's
#: folder, as compose, Kubernetes and most tools read theirs.
PATH_FIELDS = (("training", "model"), ("training", "data"), ("prefill", "checkpoint"))


def resolve_paths(data: object, base: Path) -> list[str]:
    """Rewrite, in the raw spec `data`, each relative path of `PATH_FIELDS` as read from `base`;
    returns the paths it rewrote (as rewritten)."""
    done: list[str] = []

    def resolve(value: object) -> object:
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            done.append(os.path.normpath(base.absolute() / value))  # absolute: a spec written out elsewhere keeps it
            return done[-1]
        return value

    if not isinstance(data, dict):
        return done
    for section, name in PATH_FIELDS:
        part = data.get(section)
        if not isinstance(part, dict) or part.get(name) is None:
            continue
        value = part[name]
        part[name] = [resolve(v) for v in value] if isinstance(value, list) else resolve(value)
    return done


def _load_yaml(text: str, name: str) -> object:
    """`text` as YAML (a SafeLoader: it builds no objects), its errors naming the file `name`, not
    "<unicode string>"."""
    loader = _UniqueKeyLoader(text)
    loader.name = name  # what every mark (and so every error) says
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice (YAML would silently keep the last)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a key given twice in one mapping, naming both lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: keys given beside a merge override it, as YAML means them to
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise DuplicateKeyError(f"duplicate key {key!r} at lines {seen[key]} and {line}: the last would win")
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML's) reads `3e-4` as a string: its floats need a dot (`3.0e-4`). YAML 1.2 and every
# other tool people use read it as the number it is, and docs/config.md writes defaults that way.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)
