"""What a prefill carries between blocks and bubbles (`PrefillState`) and what it ends with
(`PrefillResult`): plain values, run by `shared.model.prefill.PrefillModel`."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from shared.model.causal import KV


@dataclass
class PrefillState:
    """One request's progress: blocks ``[0, next_layer)`` have run (see `PrefillModel.run_layers`).

    `hidden` is None until the embeddings ran, then the float32 (1, T, C) input of block
    `next_layer` (the output of the last block once done). `kv[i]` is block i's (k, v), each
    float32 (1, kv_heads, T, head_dim).
    """

    tokens: list[int]
    layers: int  # the model's block count; done when next_layer == layers
    next_layer: int = 0
    hidden: Tensor | None = None
    kv: list[KV] = field(default_factory=list)
    #: the prompt's positions (T,) on the model's device: built once per request, not per block
    positions: Tensor | None = field(default=None, repr=False, compare=False)
    #: block `next_layer` run in pieces (`run_piece`): its first `piece_done` tokens' outputs and
    #: (k, v) so far; 0 and empty between layers (a snapshot is taken at a whole layer)
    piece_done: int = field(default=0, repr=False, compare=False)
    piece_out: list[Tensor] = field(default_factory=list, repr=False, compare=False)
    piece_kv: KV | None = field(default=None, repr=False, compare=False)

    @property
    def done(self) -> bool:
        return self.next_layer == self.layers


@dataclass
class PrefillResult:
    """The first generated token of a finished prefill, and the prompt's KV cache."""

    token: int
    text: str  # the model's tokenizer's text of `token` (`token_text`); U+FFFD for an id it does not know
    logprob: float  # log-softmax at temperature 1 of `token` (<= 0)
    top: list[tuple[int, float]]  # the most likely ids with their logprobs, most likely first
    prompt_tokens: int
    kv: list[KV]  # one (k, v) per layer, each (1, kv_heads, T, head_dim)
