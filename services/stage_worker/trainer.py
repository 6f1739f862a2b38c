"""The torch side of one stage: forward, backward, gradients, optimizer step.

Blocking: the runner calls these methods in a worker thread. Semantics match
`shared.model.reference.train_reference`: the last stage backpropagates loss / microbatches per
microbatch, and the all-reduce averages the replicas' summed gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.config import ClusterSpec
from shared.model.data import ByteCorpus
from shared.model.gpt import build_stage, lm_loss, make_optimizer
from shared.model.shape import GPTConfig


class StageTrainer:
    def __init__(self, spec: ClusterSpec, replica: int, stage: int, corpus: ByteCorpus) -> None:
        self.cfg = GPTConfig.from_spec(spec.model)
        self.model = build_stage(self.cfg, spec.model.seed, stage, spec.parallelism.pp)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, spec.training.lr)
        self.corpus, self.replica, self.stage = corpus, replica, stage
        self.m = spec.training.microbatches
        self.mbs, self.seq, self.data_seed = spec.training.microbatch_size, spec.model.seq_len, spec.training.seed
        self._inputs: dict[int, Tensor] = {}
        self._outputs: dict[int, Tensor] = {}
        self._losses: list[float] = []

    def _batch(self, iteration: int, mb: int) -> tuple[Tensor, Tensor]:
        return self.corpus.batch(iteration, self.replica * self.m + mb, self.mbs, self.seq, self.data_seed)

    def forward(self, iteration: int, mb: int, act: Tensor | None) -> Tensor | None:
        """Run the stage on microbatch `mb`; returns the activation to send on (None on the last stage)."""
        if self.model.is_first:
            inp, _ = self._batch(iteration, mb)  # token ids (B, T)
        else:
            assert act is not None, "a later stage needs the previous stage's activation"
            inp = act.requires_grad_(True)  # (B, T, C)
            self._inputs[mb] = inp
        out = self.model(inp)  # (B, T, C), or logits (B, T, V) on the last stage
        if self.model.is_last:
            _, targets = self._batch(iteration, mb)
            loss = lm_loss(out, targets)
            self._losses.append(loss.item())
            self._outputs[mb] = loss
            return None
        self._outputs[mb] = out
        return out.detach()

    def backward(self, mb: int, grad: Tensor | None) -> Tensor | None:
        """Backpropagate microbatch `mb`; returns the gradient for the previous stage (None on stage 0)."""
        out = self._outputs.pop(mb)
        if self.model.is_last:
            (out / self.m).backward()
        else:
            assert grad is not None, "an earlier stage needs the next stage's gradient"
            out.backward(grad)
        inp = self._inputs.pop(mb, None)
        return None if inp is None else inp.grad

    def flat_grads(self) -> Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def load_grads(self, flat: Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def take_loss(self) -> float | None:
        """Mean microbatch loss of the iteration just finished (last stage only)."""
        if not self._losses:
            return None
        loss, self._losses = sum(self._losses) / len(self._losses), []
        return loss

    def state_bytes(self) -> int:
        """Parameters, gradients and AdamW's two moments, in bytes."""
        return 4 * sum(p.numel() * p.element_size() for p in self.params)
