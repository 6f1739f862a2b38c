"""The torch side of one stage: forward, backward, gradients, optimizer step.

Blocking: the runner calls these methods in a worker thread. Semantics match
`shared.model.reference.train_reference`: the last stage backpropagates loss / microbatches per
microbatch, and the all-reduce averages the replicas' summed gradients.

Everything runs on `device` (`shared.model.devices`): the model (built on the CPU, so every device starts
from the same weights, then moved), the optimizer state, the microbatches, received activations and
gradients (moved there on arrival here), and the all-reduce's sum. Tensors handed back for the wire
are on the CPU. On a GPU every method runs on training's own high-priority stream
(`shared.model.lanes.Lane`) and ends by waiting for that stream, not the device: a step's time is
training's GPU time, prefill's kernels (on a low-priority stream) never hold it up, and no copy off
the GPU blocks the event loop. On the CPU every move is a no-op and there is no stream: the same
tensors, the same operations, bit for bit.

Tested by: tests/unit/test_recovery.py, tests/unit/test_lanes.py, tests/e2e/test_training_correctness.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shared.config.spec import ClusterSpec
from shared.model.devices import synchronize
from shared.model.gpt import lm_loss
from shared.model.hf_stage import HFStage
from shared.model.lanes import Lane, on_lane
from shared.model.optim import clip_and_step, grad_sq_norm, make_optimizer
from shared.model.training import Corpus, build_training_stage, layer_count, norm_parameters, tied_parameter


class StageTrainer:
    def __init__(
        self, spec: ClusterSpec, replica: int, stage: int, corpus: Corpus, device: torch.device | None = None
    ) -> None:
        self.device = torch.device("cpu") if device is None else device
        self.spec = spec
        self.seed, self.stages, self.lr = spec.model.seed, spec.parallelism.pp, spec.training.lr
        self.model = build_training_stage(spec, stage).to(self.device)
        synchronize(self.device)  # once, at set-up: the weights are there before the lane reads them
        #: training's stream: high priority on a GPU, none on the CPU
        self.lane = Lane.training(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        #: The tied embedding this stage shares with the other end of the pipeline (None: none).
        self.tied = tied_parameter(self.model)
        self._norm_params = norm_parameters(self.model)
        self.opt = make_optimizer(self.params, self.lr)
        self.corpus, self.replica, self.stage = corpus, replica, stage
        self.m = spec.training.microbatches
        self.mbs, self.seq, self.data_seed = spec.training.microbatch_size, spec.model.seq_len, spec.training.seed
        self._inputs: dict[int, Tensor] = {}
        self._outputs: dict[int, Tensor] = {}
        self._losses: list[Tensor] = []  # this iteration's microbatch losses, on the device
        #: The last step's learning rate, and its global gradient norm (None with clipping off).
        self.last_lr = self.lr
        self.last_grad_norm: float | None = None
        #: bf16 autocast of the forward (`training.precision: auto` on CUDA); backward follows it.
        self.bf16 = self.device.type == "cuda" and spec.training.precision == "auto"
        #: The iteration whose step these weights and optimizer state are after (-1: the initial
        #: ones). Set in the torch thread as the step ends, so it is true even when the awaiting
        #: iteration was cut short meanwhile: what a lost peer's recovery plans from.
        self.stepped = -1

    @property
    def layers(self) -> int:
        return layer_count(self.model)

    def _batch(self, iteration: int, mb: int) -> tuple[Tensor, Tensor]:
        x, y = self.corpus.batch(iteration, self.replica * self.m + mb, self.mbs, self.seq, self.data_seed)
        return x.to(self.device), y.to(self.device)  # (B, T) each

    @on_lane
    def forward(self, iteration: int, mb: int, act: Tensor | None) -> Tensor | None:
        """Run the stage on microbatch `mb`; returns the activation to send on, on the CPU (None on
        the last stage). `act` (a later stage's input) may be on any device."""
        if self.model.is_first:
            inp, _ = self._batch(iteration, mb)  # token ids (B, T)
        else:
            assert act is not None, "a later stage needs the previous stage's activation"
            inp = act.to(self.device).requires_grad_(True)  # (B, T, C)
            self._inputs[mb] = inp
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            out = self.model(inp)  # (B, T, C), or logits (B, T, V) on the last stage
        if self.model.is_last:
            _, targets = self._batch(iteration, mb)
            loss = lm_loss(out.float(), targets)
            self._losses.append(loss.detach())  # read at the step, all at once (one host sync)
            self._outputs[mb] = loss
            return None
        self._outputs[mb] = out
        sent = out.detach().cpu()  # for the wire (on the CPU: the same tensor)
        self.lane.wait()
        return sent

    @on_lane
    def backward(self, mb: int, grad: Tensor | None) -> Tensor | None:
        """Backpropagate microbatch `mb`; returns the gradient for the previous stage, on the CPU
        (None on stage 0). `grad` may be on any device."""
        out = self._outputs.pop(mb)
        if self.model.is_last:
            (out / self.m).backward()
        else:
            assert grad is not None, "an earlier stage needs the next stage's gradient"
            out.backward(grad.to(self.device))
        inp = self._inputs.pop(mb, None)
        sent = None if inp is None or inp.grad is None else inp.grad.cpu()
        self.lane.wait()
        return sent

    @on_lane
    def flat_grads(self) -> Tensor:
        """This stage's gradients as one flat tensor, on the device."""
        flat = self._flat_grads()
        self.lane.wait()
        return flat

    @on_lane
    def flat_grads_on_cpu(self) -> Tensor:
        """This stage's flat gradients on the CPU, the gloo all-reduce's input (divided by the
        group's size after the sum: for two replicas bit for bit the replica-order mean). The copy
        runs on training's lane too: on the default stream it would queue behind prefill's work."""
        return self._flat_grads().cpu()

    def _flat_grads(self) -> Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    @on_lane
    def load_grads(self, flat: Tensor) -> None:
        flat = flat.to(self.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        self.lane.wait()

    @on_lane
    def load_mean(self, grads: Sequence[Tensor]) -> None:
        """The all-reduce's arithmetic on this device: sum the replicas' flat gradients in the order
        given (replica order, on every replica, so all end with bit-identical gradients), divide by
        their number and load the mean. Inputs may be on any device."""
        total = grads[0].to(self.device).clone()
        for g in grads[1:]:
            total += g.to(self.device)
        self.load_grads(total / len(grads))

    @on_lane
    def grad_sq_norm(self) -> float:
        """This stage's share of the global gradient norm, squared (a tied copy counted once)."""
        return grad_sq_norm(self._norm_params)

    @on_lane
    def tied_grad(self) -> Tensor:
        """The tied embedding's gradient, on the CPU (the all-reduce's input)."""
        assert self.tied is not None and self.tied.grad is not None
        grad = self.tied.grad.detach().to("cpu").clone()
        self.lane.wait()
        return grad

    @on_lane
    def set_tied_grad(self, total: Tensor) -> None:
        """Both ends' gradients summed: the tied weight's whole gradient, the same on both stages."""
        assert self.tied is not None
        self.tied.grad = total.to(self.device).view_as(self.tied).clone()
        self.lane.wait()

    @on_lane
    def step(self, it: int, total_sq_norm: float | None = None) -> None:
        """The optimizer step of iteration `it` (`shared.model.optim.clip_and_step`): clipped by the
        global norm (``sqrt(total_sq_norm)``, every stage's share summed; None: this stage's own, for
        a single stage), then AdamW at the schedule's learning rate."""
        if total_sq_norm is None and self.spec.training.clip_grad_norm > 0:
            total_sq_norm = self.grad_sq_norm()  # a tied copy counted once
        self.last_lr, self.last_grad_norm = clip_and_step(self.opt, self.params, self.spec.training, it, total_sq_norm)
        self.opt.zero_grad(set_to_none=True)
        self.lane.wait()
        self.stepped = it

    @on_lane
    def take_loss(self) -> float | None:
        """Mean microbatch loss of the iteration just finished (last stage only): the microbatches'
        losses read from the device at once (its step waited for them), summed on the host in order."""
        if not self._losses:
            return None
        losses, self._losses = torch.stack(self._losses).cpu().tolist(), []
        return sum(losses) / len(losses)

    # --- checkpoints (a run survives a lost worker: shared/policies/recovery.py) ---------------

    @on_lane
    def checkpoint(self) -> bytes:
        """This stage's state after a step, as safetensors bytes: every trainable parameter
        (``param.<i>``) and AdamW's state for it (``opt.<i>.step``, ``.exp_avg``, ``.exp_avg_sq``),
        copied to the CPU. Together with the iteration it is everything the next step depends on."""
        from safetensors.torch import save

        tensors: dict[str, Tensor] = {}
        for i, p in enumerate(self.params):
            tensors[f"param.{i}"] = p.detach().to("cpu").contiguous()
            for name, value in self.opt.state.get(p, {}).items():
                tensors[f"opt.{i}.{name}"] = value.detach().to("cpu").contiguous()
        return save(tensors)

    @on_lane
    def discard(self) -> None:
        """Drop whatever a cut-short iteration left behind (its activations, losses, gradients),
        keeping the weights and optimizer state: the run resumes from the state this worker holds."""
        self._inputs.clear()
        self._outputs.clear()
        self._losses.clear()
        self.opt.zero_grad(set_to_none=True)
        self.lane.wait()

    @on_lane
    def restore(self, blob: bytes | None, after: int = -1) -> None:
        """Continue from a `checkpoint` of the state after iteration `after` (None: from the
        initial weights with a fresh optimizer), dropping whatever a cut-short iteration left
        behind. Bit-exact on the CPU: the next step computes what it would have computed had the
        run never stopped."""
        from safetensors.torch import load

        self.discard()
        self.stepped = after
        if blob is None:
            fresh = build_training_stage(self.spec, self.stage)
            weights = [p.detach() for p in fresh.parameters() if p.requires_grad]
            state: dict[int, dict[str, Tensor]] = {}
        else:
            tensors = load(blob)
            weights = [tensors[f"param.{i}"] for i in range(len(self.params))]
            state = {}
            for key, value in tensors.items():
                if key.startswith("opt."):
                    _, i, name = key.split(".", 2)
                    state.setdefault(int(i), {})[name] = value
        with torch.no_grad():
            for p, w in zip(self.params, weights, strict=True):
                p.copy_(w.to(self.device))
        # The optimizer's own loader puts each moment on its parameter's device (the step count
        # stays on the CPU, as AdamW keeps it).
        self.opt = make_optimizer(self.params, self.lr)
        if state:
            self.opt.load_state_dict({"state": state, "param_groups": self.opt.state_dict()["param_groups"]})
        self.lane.wait()

    @on_lane
    def saved_tensors(self) -> dict[str, Tensor]:
        """The stage's weights as the save directory stores them: a Hugging Face model's under its
        checkpoint names (`HFStage.hf_tensors`), the small GPT's under the full model's names (the
        launcher exports them as GPT-2)."""
        if isinstance(self.model, HFStage):
            return self.model.hf_tensors()
        return {name: p.detach().to("cpu").contiguous() for name, p in self.model.global_named_parameters()}

    def state_bytes(self) -> int:
        """Parameters, gradients and AdamW's two moments, in bytes."""
        return 4 * sum(p.numel() * p.element_size() for p in self.params)
