"""The model's shape and the arithmetic on it, without torch (the dispatcher plans with this).

`GPTConfig` is the shape `shared.model.gpt` builds; `split_layers` is how its blocks are cut into
pipeline stages; `estimate_kv_bytes` is the size of a prompt's KV cache before it is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ModelSpec

FLOAT32_BYTES = 4


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
