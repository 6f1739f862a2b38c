"""A small nanoGPT-shaped GPT (pre-LayerNorm, no dropout, no weight tying), cut into pipeline stages.

Stage `s` of `S` owns the contiguous block range ``split_layers(cfg.layers, S)[s]``; stage 0 also
owns the embeddings (`wte`, `wpe`), the last stage also owns `ln_f` and `lm_head`. The full model
is simply stage 0 of 1, so the pipeline and the single-process reference run the same code.

Initialisation is a pure function of ``(seed, global parameter name)``: every parameter is drawn
from its own generator seeded with `derive_seed("gpt-init", seed, name)`, where `name` is the
parameter's name in the full model (e.g. ``blocks.3.attn.c_attn.weight``). So `build_stage`
yields exactly the corresponding parameters of `build_full` without building the whole model,
and neither touches the global RNG. Weight tying is deliberately absent: it would make the first
and the last stage share a tensor.

The shape (`GPTConfig`) and the stage split (`split_layers`) need no torch: they live in
`shared.model.shape` and are importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model.optim import make_optimizer as make_optimizer  # the one optimizer; importable from here too
from shared.model.seeds import generator
from shared.model.shape import GPTConfig, split_layers

INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def _attend(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Causal attention before the output projection: (y (B, T, C), k, v (B, nh, T, hs) views)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return y.transpose(1, 2).contiguous().view(B, T, C), k, v  # (B, T, C): heads side by side

    def forward(self, x: Tensor) -> Tensor:
        y, _, _ = self._attend(x)
        return self.c_proj(y)  # (B, T, C)

    def forward_kv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`forward(x)` plus this layer's keys and values, for a KV cache.

        Returns ``(y, k, v)``: `y` is bit-identical to ``forward(x)`` (the same operations), `k` and
        `v` are contiguous copies of shape (B, heads, T, head_dim), so keeping them does not keep
        the whole (B, T, 3C) projection alive.
        """
        y, k, v = self._attend(x)
        return self.c_proj(y), k.contiguous(), v.contiguous()  # (B, T, C), 2 x (B, nh, T, hs)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)

    def forward_kv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`forward(x)` (bit-identical) plus the attention's k and v, each (B, heads, T, head_dim)."""
        y, k, v = self.attn.forward_kv(self.ln_1(x))  # (B, T, C), 2 x (B, nh, T, hs)
        x = x + y  # (B, T, C)
        return x + self.mlp(self.ln_2(x)), k, v  # (B, T, C), 2 x (B, nh, T, hs)


class StageModule(nn.Module):
    """Pipeline stage `stage` of `stages` (see the module docstring for what each stage owns).

    `forward(x)`: on the first stage `x` is token ids, int64 (B, T) with T <= cfg.seq_len; on
    any other stage it is the previous stage's hidden state, float32 (B, T, C). The result is the
    hidden state float32 (B, T, C), or the logits float32 (B, T, vocab) on the last stage.
    Parameters live on the CPU in float32.
    """

    wte: nn.Embedding | None
    wpe: nn.Embedding | None
    ln_f: nn.LayerNorm | None
    lm_head: nn.Linear | None

    def __init__(
        self, cfg: GPTConfig, *, seed: int, stage: int, stages: int, ranges: list[tuple[int, int]] | None = None
    ) -> None:
        super().__init__()
        ranges = split_layers(cfg.layers, stages) if ranges is None else ranges
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in [0, {stages}), got {stage}")
        self.cfg = cfg
        self.seed = seed
        self.stage = stage
        self.stages = stages
        self.layer_range = ranges[stage]  # global indices [start, end) of this stage's blocks
        # Build on the meta device (no memory, no RNG use), then allocate and initialise explicitly.
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.vocab, cfg.d_model) if self.is_first else None
            self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if self.is_first else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(*self.layer_range))
            self.ln_f = nn.LayerNorm(cfg.d_model) if self.is_last else None
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False) if self.is_last else None
        self.to_empty(device="cpu")
        self._init_parameters()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def global_name(self, name: str) -> str:
        """The full model's name for this stage's parameter `name` (block indices become global)."""
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            return f"blocks.{self.layer_range[0] + int(index)}.{rest}"
        return name

    def global_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Like `named_parameters`, but named as in the full model (see `global_name`)."""
        for name, p in self.named_parameters():
            yield self.global_name(name), p

    @torch.no_grad()
    def _init_parameters(self) -> None:
        # Linear/Embedding weights ~ N(0, 0.02), biases 0, LayerNorm weight 1 and bias 0; each
        # random tensor from a generator keyed by (seed, global name) so every stage agrees.
        for mod_name, mod in self.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                full = self.global_name(f"{mod_name}.{p_name}" if mod_name else p_name)
                if isinstance(mod, nn.LayerNorm) and p_name == "weight":
                    p.fill_(1.0)
                elif p_name == "bias":
                    p.zero_()
                elif isinstance(mod, (nn.Linear, nn.Embedding)):
                    p.normal_(0.0, INIT_STD, generator=generator("gpt-init", self.seed, full))
                else:  # a parameter this scheme does not know: refuse rather than leave it uninitialised
                    raise TypeError(f"no initialisation rule for parameter {full} of {type(mod).__name__}")

    def forward(self, x: Tensor) -> Tensor:
        if self.wte is not None and self.wpe is not None:
            if x.dim() != 2 or x.dtype != torch.long:
                raise ValueError(f"stage 0 takes int64 token ids (B, T), got {x.dtype} {tuple(x.shape)}")
            seq = x.shape[1]
            if seq > self.cfg.seq_len:
                raise ValueError(f"sequence length {seq} exceeds the model's seq_len {self.cfg.seq_len}")
            pos = torch.arange(seq, dtype=torch.long, device=x.device)  # (T,)
            x = self.wte(x) + self.wpe(pos)  # (B, T, C) + (T, C) -> (B, T, C)
        elif x.dim() != 3 or x.shape[2] != self.cfg.d_model or not x.is_floating_point():
            raise ValueError(
                f"stage {self.stage} takes a float hidden state (B, T, {self.cfg.d_model}), "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        if self.ln_f is not None and self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return x


def build_stage(
    cfg: GPTConfig, seed: int, stage: int, stages: int, ranges: list[tuple[int, int]] | None = None
) -> StageModule:
    """Stage `stage` of a `stages`-way split (`ranges`, default `split_layers`), with exactly the
    parameters of `build_full(cfg, seed)`."""
    return StageModule(cfg, seed=seed, stage=stage, stages=stages, ranges=ranges)


def build_full(cfg: GPTConfig, seed: int) -> StageModule:
    """The whole model as one stage (token ids in, logits out)."""
    return build_stage(cfg, seed, 0, 1)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits (B, T, V) float, targets (B, T) int64 -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # (B*T, V) vs (B*T,)
