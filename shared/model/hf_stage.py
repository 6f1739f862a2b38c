"""A pipeline stage of a Hugging Face family (gpt2, llama, mistral, qwen2) that trains.

One model code path for training and serving: a stage *is* the family module prefill runs
(`shared.model.families`), built from the same `config.json`, cut to what the stage owns:

* stage `s` of `S` keeps the layers ``ranges[s]`` (the others become empty modules, so every
  parameter keeps the full model's name: ``layers.5.mlp.up_proj.weight`` on whichever stage holds
  layer 5);
* the first stage keeps the embeddings (`EMBEDDINGS`), the last the final norm and head (`FINAL`);
* with tied embeddings (`tie_word_embeddings`) the last stage also keeps a copy of the token
  embedding, which its head reads. The two copies start equal and stay equal: each step the
  trainer sums their gradients across the two stages before the optimizer steps (Megatron's way),
  so both take the same update. With one stage the module holds the one tensor, as transformers.

`forward(x)` runs ``embed`` (first stage: token ids (B, T)), the owned ``block``s, and ``logits``
(last stage: (B, T, vocab)) of the family over positions 0..T-1, causal attention, no cache.

Weights: from the directory's safetensors (validated as the serving loader does, then only this
stage's tensors kept), or initialised as the family does in transformers: linear and embedding
weights ~ N(0, initializer_range), biases 0, norm weights 1 (and biases 0); GPT-2's residual
projections (``c_proj``) ~ N(0, initializer_range / sqrt(2 n_layer)). Each tensor is drawn from a
generator keyed by (seed, its checkpoint name), so every stage, and the tied copy, agree without
communication and without the global RNG.

`hf_tensors()` gives the stage's tensors under the checkpoint's names, stored as transformers
stores them (GPT-2's Conv1D weights transposed back); the tied copy on the last stage is left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from shared.config.model_info import ModelInfo, info_from_config
from shared.model.causal import LoadableLM, config_float
from shared.model.checkpoint import FAMILIES, checked_state, read_tensors
from shared.model.seeds import generator

DEFAULT_INITIALIZER_RANGE = 0.02


class HFStage(nn.Module):
    """Stage `stage` of `len(ranges)` of the family model of `config` (see the module docstring)."""

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        stage: int,
        ranges: list[tuple[int, int]],
        seed: int,
        weights: str | Path | None = None,
    ) -> None:
        super().__init__()
        info = info_from_config(config)
        if not 0 <= stage < len(ranges):
            raise ValueError(f"stage must be in [0, {len(ranges)}), got {stage}")
        self.info: ModelInfo = info
        self.config = dict(config)
        self.stage, self.stages, self.seed = stage, len(ranges), seed
        self.layer_range = ranges[stage]
        self.is_first, self.is_last = stage == 0, stage == len(ranges) - 1
        lm = FAMILIES[config["model_type"]].from_config(config, info)  # on the meta device
        self.tied = lm.tied
        #: Whether this stage holds the last stage's copy of a tied embedding (gradient summed).
        self.holds_tied_copy = self.tied and self.is_last and not self.is_first
        if weights is not None:  # validated whole, as prefill loads it, before the module is cut
            directory = Path(weights)
            full = checked_state(lm, read_tensors(directory), directory)
        self._cut(lm)
        kept = {n: b.clone() for n, b in lm.named_buffers() if not b.is_meta}  # computed buffers (rotary)
        lm.to_empty(device="cpu")
        with torch.no_grad():
            for name, buf in lm.named_buffers():
                if name in kept:
                    buf.copy_(kept[name])
        self.lm: LoadableLM = lm
        if weights is None:
            self._init_parameters()
        else:
            own = dict(self.lm.named_parameters())
            with torch.no_grad():
                for name, p in own.items():
                    p.copy_(full[name])

    def _cut(self, lm: LoadableLM) -> None:
        for attr in lm.EMBEDDINGS:
            if not self.is_first and not (self.holds_tied_copy and attr == lm.TIED_EMBEDDING):
                setattr(lm, attr, None)
        if not self.is_last:
            for attr in lm.FINAL:
                setattr(lm, attr, None)
        layers = getattr(lm, lm.LAYERS)
        start, end = self.layer_range
        for i in range(len(layers)):
            if not start <= i < end:
                layers[i] = nn.Module()  # no parameters: the full model's indices stay

    # --- names -------------------------------------------------------------------------------

    def checkpoint_names(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(module name, checkpoint name, parameter) of every trainable tensor of this stage."""
        for name, p in self.lm.named_parameters():
            yield name, self.lm.checkpoint_name(name), p

    def is_tied_copy(self, name: str) -> bool:
        """Whether module parameter `name` is the last stage's copy of the tied embedding."""
        return self.holds_tied_copy and name == f"{self.lm.TIED_EMBEDDING}.weight"

    def hf_tensors(self) -> dict[str, Tensor]:
        """The stage's tensors as a checkpoint stores them (CPU, contiguous; the tied copy left out)."""
        out: dict[str, Tensor] = {}
        for name, ckpt, p in self.checkpoint_names():
            if self.is_tied_copy(name):
                continue
            t = p.detach().to("cpu")
            out[ckpt] = (t.t() if self.lm.transposed(name) else t).contiguous()
        return out

    # --- initialisation ------------------------------------------------------------------------

    @torch.no_grad()
    def _init_parameters(self) -> None:
        std = config_float(self.config, "initializer_range", DEFAULT_INITIALIZER_RANGE)
        gpt2 = self.info.family == "gpt2"
        residual_std = std / math.sqrt(2 * self.info.layers)
        for mod_name, mod in self.lm.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                key = self.lm.checkpoint_name(name)
                if p_name == "bias":
                    p.zero_()
                elif isinstance(mod, (nn.Linear, nn.Embedding)):
                    scale = residual_std if gpt2 and name.endswith("c_proj.weight") else std
                    p.normal_(0.0, scale, generator=generator("hf-init", self.seed, key))
                elif p_name == "weight":  # LayerNorm / RMSNorm
                    p.fill_(1.0)
                else:
                    raise TypeError(f"no initialisation rule for parameter {key} of {type(mod).__name__}")

    # --- compute -------------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        """First stage: token ids int64 (B, T); others: the hidden state (B, T, C). Returns the
        hidden state, or the logits (B, T, vocab) on the last stage."""
        seq = x.shape[1]
        if seq > self.info.max_model_len:
            raise ValueError(f"sequence length {seq} exceeds the model's {self.info.max_model_len} positions")
        positions = torch.arange(seq, dtype=torch.long, device=x.device)  # (T,)
        hidden = self.lm.embed(x, positions) if self.is_first else x  # (B, T, C)
        for i in range(*self.layer_range):
            hidden, _ = self.lm.block(i, hidden, positions, None)
        return self.lm.logits(hidden) if self.is_last else hidden
