"""The model's shape and the arithmetic on it, without torch (the dispatcher plans with this).

`GPTConfig` is the shape `shared.model.gpt` builds; `split_layers` is how its blocks are cut into
pipeline stages (`stage_layer_ranges`: by the spec's `parallelism.split`, evenly or by each
layer's cost with `balanced_split`); `estimate_kv_bytes` is the size of a prompt's KV cache before it is computed.

`model_info(prefill_spec)` is the shape of whatever model serves prefill (the seeded or trained
nanoGPT, or a Hugging Face checkpoint directory), read without torch: from a checkpoint directory's
`config.json` (`shared.config.model_info`), otherwise from `prefill.model`. The front door takes its
limits from it and the dispatcher its layer count and KV sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.config.model_info import FLOAT32_BYTES, ModelInfo, info_from_config, read_config
from shared.config.spec import ClusterSpec, Prefill
from shared.config.training import ModelSpec


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. Dropout is always 0, so a forward pass is a deterministic function."""

    layers: int
    d_model: int
    heads: int
    seq_len: int  # the longest sequence the position embedding covers
    vocab: int

    def __post_init__(self) -> None:
        for field in ("layers", "d_model", "heads", "seq_len", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.d_model % self.heads:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be a multiple of heads ({self.heads})")

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> GPTConfig:
        """The model shape of a cluster spec's `model` section (its `seed` is passed separately)."""
        return cls(layers=spec.layers, d_model=spec.d_model, heads=spec.heads, seq_len=spec.seq_len, vocab=spec.vocab)

    def info(self) -> ModelInfo:
        """The served-model shape of the nanoGPT of `shared.model.gpt` with this shape."""
        return ModelInfo(
            family="nanogpt",
            layers=self.layers,
            vocab=self.vocab,
            d_model=self.d_model,
            heads=self.heads,
            kv_heads=self.heads,
            head_dim=self.d_model // self.heads,
            max_model_len=self.seq_len,
        )


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` block ranges, one per stage, covering ``range(layers)``.

    Sizes differ by at most one and the earlier stages get the extra blocks, e.g.
    ``split_layers(5, 2) == [(0, 3), (3, 5)]``. Every stage gets at least one block:
    `ValueError` if ``stages < 1`` or ``stages > layers``.
    """
    if stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {stages}")
    if stages > layers:
        raise ValueError(f"cannot split {layers} layers into {stages} stages (at most one stage per layer)")
    base, extra = divmod(layers, stages)
    ranges: list[tuple[int, int]] = []
    start = 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def estimate_kv_bytes(cfg: GPTConfig, tokens: int) -> int:
    """Bytes of a full KV cache for a `tokens`-long prompt: k and v, float32, every layer.

    Each layer keeps k and v of shape (1, heads, tokens, head_dim), i.e. ``tokens * d_model``
    floats each, so the total is ``2 * layers * tokens * d_model * 4`` bytes.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return 2 * cfg.layers * tokens * cfg.d_model * FLOAT32_BYTES


def is_checkpoint_dir(spec: Prefill) -> bool:
    """Whether `prefill.checkpoint` names a directory (a Hugging Face model) rather than a file."""
    return spec.checkpoint is not None and Path(spec.checkpoint).is_dir()


def model_info(spec: Prefill) -> ModelInfo:
    """The shape of the model a spec's `prefill` section serves, without torch.

    A `checkpoint` that is a directory: its `config.json` (`CheckpointError` if it is missing or
    unsupported). Otherwise (no checkpoint, or a nanoGPT state_dict file, which only the worker
    reads): `prefill.model`, with `max_model_len` its `seq_len`.
    """
    if is_checkpoint_dir(spec):
        assert spec.checkpoint is not None
        return info_from_config(read_config(spec.checkpoint))
    return GPTConfig.from_spec(spec.model).info()


def max_prompt_tokens(spec: Prefill, info: ModelInfo) -> int:
    """The longest prompt the front door accepts (and the simulator's load may hold):
    `prefill.max_prompt_tokens`, capped by what the served model `info` can take."""
    return min(spec.max_prompt_tokens, info.max_model_len)


def balanced_split(costs: list[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges of `costs` (every stage at least one item) whose largest sum is as small
    as it can be; ties go to the earlier stages. `ValueError` if there are fewer items than stages."""
    n = len(costs)
    if stages < 1 or stages > n:
        raise ValueError(f"cannot split {n} layers into {stages} stages (at least one layer each)")

    def cut(limit: float) -> list[tuple[int, int]] | None:
        ranges: list[tuple[int, int]] = []
        start, total = 0, 0.0
        for i, c in enumerate(costs):
            left_items, left_stages = n - i, stages - len(ranges)
            if i > start and (total + c > limit or left_items < left_stages):
                ranges.append((start, i))
                start, total = i, 0.0
            total += c
        ranges.append((start, n))
        return ranges if len(ranges) <= stages and max(costs) <= limit else None

    lo, hi = max(costs), sum(costs)
    for _ in range(100):  # bisect the smallest feasible largest-stage cost
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    ranges = cut(hi)
    assert ranges is not None
    while len(ranges) < stages:  # fewer stages than asked: split the widest (never raises the largest sum)
        i = max(range(len(ranges)), key=lambda j: ranges[j][1] - ranges[j][0])
        a, b = ranges[i]
        ranges[i : i + 1] = [(a, b - 1), (b - 1, b)]
    return ranges


def stage_layer_ranges(spec: ClusterSpec) -> list[tuple[int, int]]:
    """Each stage's ``[start, end)`` layers, by `parallelism.split` (the cost stated in config.md)."""
    m, stages = spec.model, spec.parallelism.pp
    if spec.parallelism.split == "layers":
        return split_layers(m.layers, stages)
    layer = 12.0 * m.d_model * m.d_model
    costs = [layer] * m.layers
    costs[0] += m.vocab * m.d_model  # the embedding
    costs[-1] += m.vocab * m.d_model  # the head (tied or not, it is a vocab x d_model matmul)
    return balanced_split(costs, stages)
