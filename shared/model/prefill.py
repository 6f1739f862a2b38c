"""Prefill (prompt-phase) inference for prefill-as-a-service: resumable, one layer at a time.

A worker runs a prompt inside pipeline bubbles, so a prefill must be able to stop at any layer
boundary and resume later, possibly much later and on a copy of its state:

    model = PrefillModel(cfg, seed=0)
    state = model.start(encode("Hello"))          # validated prompt, nothing computed yet
    model.run_layers(state, max_layers=2)         # embeddings + blocks 0, 1
    model.run_layers(state, should_stop=bubble_over)  # more blocks, until the bubble closes
    ...
    result = model.finish(state)                  # once state.done: next token, logprobs, KV cache

Resuming is exact: the blocks run the same operations on the same tensors however the run is
split, so the first token, its logprob and every KV tensor are bit-identical to one uninterrupted
`prefill`. All computation happens under `torch.inference_mode()` on the CPU in float32; the
tensors in a state are therefore inference tensors (fine to read, copy and resume from, not to
use in autograd).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.config import Prefill
from shared.model.gpt import Block, StageModule, build_full
from shared.model.shape import GPTConfig
from shared.model.shape import estimate_kv_bytes as estimate_kv_bytes  # re-exported: it used to live here
from shared.model.tokenizer import decode

KV = tuple[Tensor, Tensor]  # (k, v) of one layer, each float32 (1, heads, T, head_dim)


class CheckpointError(ValueError):
    """A checkpoint file does not hold a state_dict of the full model with the expected shape."""


@dataclass
class PrefillState:
    """One request's progress: blocks ``[0, next_layer)`` have run (see `PrefillModel.run_layers`).

    `hidden` is None until the embeddings ran, then the float32 (1, T, C) input of block
    `next_layer` (the output of the last block once done). `kv[i]` is block i's (k, v).
    """

    tokens: list[int]
    layers: int  # the model's block count; done when next_layer == layers
    next_layer: int = 0
    hidden: Tensor | None = None
    kv: list[KV] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.next_layer == self.layers


@dataclass
class PrefillResult:
    """The first generated token of a finished prefill, and the prompt's KV cache."""

    token: int
    text: str  # decode([token]); U+FFFD if the id is not a byte or the byte is not UTF-8 on its own
    logprob: float  # log-softmax at temperature 1 of `token` (<= 0)
    top: list[tuple[int, float]]  # the most likely ids with their logprobs, most likely first
    prompt_tokens: int
    kv: list[KV]  # one (k, v) per layer, each (1, heads, T, head_dim)


class PrefillModel:
    """A full `StageModule` in eval mode, frozen, run only under `torch.inference_mode()`.

    `PrefillModel(cfg, seed)` has the weights of `build_full(cfg, seed)`; with `state_dict` the
    weights are replaced by those (checked like a checkpoint, `CheckpointError` if they do not
    fit). Prompts may have at most ``min(cfg.seq_len, max_prompt_tokens)`` tokens. The model holds
    no per-request state, so one instance can serve many interleaved requests.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        seed: int = 0,
        *,
        state_dict: Mapping[str, object] | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        self.cfg = cfg
        self.max_tokens = cfg.seq_len if max_prompt_tokens is None else min(cfg.seq_len, max_prompt_tokens)
        self.module = build_full(cfg, seed)
        if state_dict is not None:
            _check_state_dict(self.module, state_dict)
            self.module.load_state_dict(state_dict, strict=True)
        self.module.eval().requires_grad_(False)

    @classmethod
    def from_checkpoint(cls, path: str | Path, cfg: GPTConfig, *, max_prompt_tokens: int | None = None) -> PrefillModel:
        """A model with the weights of a full model's state_dict saved by `save_checkpoint` (or torch.save).

        Loaded with ``torch.load(weights_only=True)`` (no pickled code runs). `CheckpointError` if
        the file cannot be read, or misses, adds or reshapes any parameter of `cfg`'s model.
        """
        try:
            loaded = torch.load(Path(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # OSError, unpickling refusals, corrupt archives: all "cannot load"
            raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from exc
        if not isinstance(loaded, Mapping):
            raise CheckpointError(f"checkpoint {path} holds a {type(loaded).__name__}, not a state_dict")
        try:
            return cls(cfg, state_dict=loaded, max_prompt_tokens=max_prompt_tokens)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None

    @classmethod
    def from_spec(cls, spec: Prefill) -> PrefillModel:
        """The model of a spec's `prefill` section: its checkpoint if set, else seeded with `model.seed`."""
        cfg = GPTConfig.from_spec(spec.model)
        if spec.checkpoint is not None:
            return cls.from_checkpoint(spec.checkpoint, cfg, max_prompt_tokens=spec.max_prompt_tokens)
        return cls(cfg, spec.model.seed, max_prompt_tokens=spec.max_prompt_tokens)

    def start(self, tokens: Sequence[int]) -> PrefillState:
        """A fresh state for prompt `tokens`; `ValueError` if it is empty, too long or has a bad id."""
        ids = list(tokens)
        if not ids:
            raise ValueError("prompt is empty: a prefill needs at least one token")
        if len(ids) > self.max_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than this model's limit of {self.max_tokens}")
        for pos, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab:
                raise ValueError(f"prompt token {t!r} at position {pos} is not an id in 0..{self.cfg.vocab - 1}")
        return PrefillState(tokens=ids, layers=self.cfg.layers)

    def run_layers(
        self,
        state: PrefillState,
        max_layers: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> PrefillState:
        """Advance `state` in place (and return it): embeddings if not yet run, then blocks in order.

        Before each block, stops at that layer boundary if `should_stop()` returns True; stops
        after `max_layers` blocks (None = no limit; 0 = embeddings only); stops when done (a done
        state is returned unchanged). Never leaves a block half-run, so every stop is resumable.
        """
        if max_layers is not None and max_layers < 0:
            raise ValueError(f"max_layers must be >= 0 or None, got {max_layers}")
        self._check_state(state)
        ran = 0
        with torch.inference_mode():
            if state.hidden is None:
                ids = torch.tensor([state.tokens], dtype=torch.long)  # (1, T)
                pos = torch.arange(ids.shape[1], dtype=torch.long)  # (T,)
                assert self.module.wte is not None and self.module.wpe is not None  # a full model has both
                state.hidden = self.module.wte(ids) + self.module.wpe(pos)  # (1, T, C) + (T, C) -> (1, T, C)
            while not state.done and (max_layers is None or ran < max_layers):
                if should_stop is not None and should_stop():
                    break
                block = self.module.blocks[state.next_layer]
                assert isinstance(block, Block)  # ModuleList items are typed as plain Modules
                state.hidden, k, v = block.forward_kv(state.hidden)  # (1, T, C), 2 x (1, nh, T, hs)
                state.kv.append((k, v))
                state.next_layer += 1
                ran += 1
        return state

    def last_logits(self, state: PrefillState) -> Tensor:
        """ln_f + lm_head of the last prompt position of a done state: float32 (vocab,)."""
        if not state.done:
            raise ValueError(f"prefill not finished: {state.next_layer} of {state.layers} layers have run")
        self._check_state(state)
        assert state.hidden is not None and self.module.ln_f is not None and self.module.lm_head is not None
        with torch.inference_mode():
            last = state.hidden[:, -1, :]  # (1, C)
            return self.module.lm_head(self.module.ln_f(last))[0]  # (1, C) -> (1, vocab) -> (vocab,)

    def finish(
        self, state: PrefillState, *, temperature: float = 0.0, seed: int | None = None, top_logprobs: int = 0
    ) -> PrefillResult:
        """The next token after the prompt of a done state (`ValueError` if not done); `state` is unchanged.

        ``temperature == 0``: the argmax (greedy). Otherwise a sample from softmax(logits /
        temperature), drawn with a local generator seeded by `seed` (same seed, same token; None =
        fresh entropy); the global RNG is never used. `logprob` and `top` are at temperature 1.
        """
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
        logits = self.last_logits(state)  # (vocab,)
        with torch.inference_mode():
            logprobs = F.log_softmax(logits, dim=-1)  # (vocab,)
            if temperature == 0:
                token = int(torch.argmax(logits).item())
            else:
                gen = torch.Generator(device="cpu")
                if seed is None:
                    gen.seed()
                else:
                    gen.manual_seed(seed)
                # Shift by the max before dividing: a tiny temperature then gives -inf (probability
                # 0) for the others instead of inf - inf = nan.
                probs = F.softmax((logits - logits.max()) / temperature, dim=-1)  # (vocab,)
                token = int(torch.multinomial(probs, 1, generator=gen).item())
            k = min(top_logprobs, self.cfg.vocab)
            top_vals, top_ids = torch.topk(logprobs, k)  # (k,), (k,): sorted, most likely first
            top = [(int(i), float(lp)) for i, lp in zip(top_ids.tolist(), top_vals.tolist(), strict=True)]
        return PrefillResult(
            token=token,
            text=decode([token]) if token < 256 else "\ufffd",
            logprob=float(logprobs[token].item()),
            top=top,
            prompt_tokens=len(state.tokens),
            kv=list(state.kv),
        )

    def prefill(
        self, tokens: Sequence[int], *, temperature: float = 0.0, seed: int | None = None, top_logprobs: int = 0
    ) -> PrefillResult:
        """One uninterrupted prefill: `start`, `run_layers` to the end, `finish`."""
        state = self.run_layers(self.start(tokens))
        return self.finish(state, temperature=temperature, seed=seed, top_logprobs=top_logprobs)

    def _check_state(self, state: PrefillState) -> None:
        """`ValueError` if `state` is inconsistent or was started by a model of another shape."""
        T, C = len(state.tokens), self.cfg.d_model
        if state.layers != self.cfg.layers or not 0 <= state.next_layer <= state.layers:
            raise ValueError(
                f"state is at layer {state.next_layer} of {state.layers}, but this model has {self.cfg.layers} layers"
            )
        if len(state.kv) != state.next_layer:
            raise ValueError(f"state has {len(state.kv)} KV entries for {state.next_layer} finished layers")
        if state.hidden is None and state.next_layer:
            raise ValueError(f"state is at layer {state.next_layer} but has no hidden state")
        if state.hidden is not None and tuple(state.hidden.shape) != (1, T, C):
            raise ValueError(f"state hidden has shape {tuple(state.hidden.shape)}, expected {(1, T, C)}")


def _check_state_dict(module: StageModule, loaded: Mapping[str, object]) -> None:
    """`CheckpointError` naming every missing, unexpected, non-tensor or reshaped entry."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for name, want in expected.items():
        got = loaded.get(name)
        if name in loaded and not (isinstance(got, Tensor) and got.is_floating_point()):
            problems.append(f"{name} is {type(got).__name__}, not a float tensor")
        elif isinstance(got, Tensor) and got.shape != want.shape:
            problems.append(f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if problems:
        raise CheckpointError(f"state_dict does not fit the model {module.cfg}: " + "; ".join(problems))


def save_checkpoint(model: PrefillModel | StageModule, path: str | Path) -> None:
    """torch.save the full model's state_dict to `path`, atomically (a temporary file, then rename)."""
    module = model.module if isinstance(model, PrefillModel) else model
    if module.stages != 1:
        raise ValueError(f"only a full model can be saved, got stage {module.stage} of {module.stages}")
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        torch.save(module.state_dict(), tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def kv_bytes(item: PrefillState | PrefillResult) -> int:
    """Bytes held by the KV tensors of a state (finished layers only) or a result."""
    return sum(t.numel() * t.element_size() for kv in item.kv for t in kv)
