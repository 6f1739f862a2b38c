"""The project's nanoGPT (`shared.model.gpt`) as a `CausalLM`.

`NanoGPT` *is* the full `StageModule` (stage 0 of 1): the same parameters under the same names,
the same seeded initialisation, the same state_dict files. A prompt's first pass runs each block's
`forward_kv` unchanged, so prefills are bit-for-bit what they were before this interface existed;
only a pass with a cache (a decode step) takes the attention apart to attend over the past too.
"""

from __future__ import annotations

from torch import Tensor

from shared.model.causal import KV, CausalLM, attend, extend_cache
from shared.model.gpt import Block, StageModule
from shared.model.shape import GPTConfig


class NanoGPT(StageModule, CausalLM):
    """The full nanoGPT of shape `cfg`, weights from `seed` (see `shared.model.gpt`)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__(cfg, seed=seed, stage=0, stages=1)
        self.info = cfg.info()

    def _block(self, i: int) -> Block:
        block = self.blocks[i]
        assert isinstance(block, Block)  # ModuleList items are typed as plain Modules
        return block

    def embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        assert self.wte is not None and self.wpe is not None  # a full model has both
        return self.wte(ids) + self.wpe(positions)  # (1, T, C) + (T, C) -> (1, T, C)

    def block(self, i: int, hidden: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        blk = self._block(i)
        if past is None:  # the prompt's pass: exactly the training model's block
            out, k, v = blk.forward_kv(hidden)  # (1, T, C), 2 x (1, nh, T, hs)
            return out, (k, v)
        x = blk.ln_1(hidden)
        B, T, C = x.shape
        nh = self.cfg.heads
        q, k, v = blk.attn.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, C // nh).transpose(1, 2)
        v = v.view(B, T, nh, C // nh).transpose(1, 2)
        k, v = extend_cache(past, k, v)  # (B, nh, T_total, hs)
        y = attend(q, k, v).transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        hidden = hidden + blk.attn.c_proj(y)
        return hidden + blk.mlp(blk.ln_2(hidden)), (k, v)

    def head(self, hidden_last: Tensor) -> Tensor:
        assert self.ln_f is not None and self.lm_head is not None  # a full model has both
        return self.lm_head(self.ln_f(hidden_last))[0]  # (1, C) -> (1, vocab) -> (vocab,)
