"""Prefill (prompt-phase) inference for prefill-as-a-service: resumable, one layer at a time.

A worker runs a prompt inside pipeline bubbles, so a prefill must be able to stop at any layer
boundary and resume later, possibly much later and on a copy of its state:

    model = PrefillModel.from_spec(spec.prefill)  # or PrefillModel(cfg, seed=0), PrefillModel(lm)
    state = model.start(model.tokenizer.encode("Hello"))  # validated prompt, nothing computed yet
    model.run_layers(state, max_layers=2)         # embeddings + blocks 0, 1
    model.run_layers(state, should_stop=bubble_over)  # more blocks, until the bubble closes
    ...
    result = model.finish(state)                  # once state.done: next token, logprobs, KV cache

The model is any `CausalLM` (`shared.model.causal`), run layer by layer: the seeded or trained
nanoGPT, or a Hugging Face checkpoint directory (`shared.model.checkpoint`: GPT-2, Llama, Mistral,
Qwen2). `from_spec` picks it from the spec's `prefill` section, with the tokenizer that goes with
it. After a prefill, `decode_step` runs one more token at a time through every block with the
cache (what a decoder does), and `sample` is the one sampling rule for both.

Resuming is exact: the blocks run the same operations on the same tensors however the run is
split, so the first token, its logprob and every KV tensor are bit-identical to one uninterrupted
`prefill`. All computation happens under `torch.inference_mode()` on the device and in the dtype of
the weights (float32 unless `place` casts them: a worker's guest on a GPU is bfloat16, `guest_dtype`
in `shared.model.devices`; logits are float32 either way); the tensors in a state are therefore
inference tensors (fine to read, copy and resume from, not to use in autograd).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from shared.config.model_info import CheckpointError, ModelInfo
from shared.config.spec import Prefill
from shared.model.causal import KV as KV  # re-exported: (k, v) of one layer, each (1, kv_heads, T, head_dim)
from shared.model.causal import CausalLM
from shared.model.checkpoint import check_state_dict, load_causal_lm
from shared.model.families.nanogpt import NanoGPT
from shared.model.finishing import Finishing, to_host
from shared.model.gpt import StageModule
from shared.model.graphs import GraphedBlocks, capture_plan
from shared.model.lanes import Lane
from shared.model.prefill_state import PrefillResult as PrefillResult  # re-exported: defined beside
from shared.model.prefill_state import PrefillState as PrefillState
from shared.model.sampling import sample as sample  # re-exported: the one sampling rule, decoders' too
from shared.model.shape import GPTConfig
from shared.model.shape import estimate_kv_bytes as estimate_kv_bytes  # re-exported: it used to live here
from shared.model.tokenizer import BYTES, Tokenizer, tokenizer_for


class PrefillModel:
    """A `CausalLM` in eval mode, frozen, run only under `torch.inference_mode()`.

    `PrefillModel(lm)` serves any `CausalLM` (e.g. `load_causal_lm(directory)`). For the nanoGPT,
    `PrefillModel(cfg, seed)` has the weights of `build_full(cfg, seed)`; with `state_dict` the
    weights are replaced by those (checked like a checkpoint, `CheckpointError` if they do not
    fit). Prompts may have at most ``min(info.max_model_len, max_prompt_tokens)`` tokens
    (`max_tokens`). `tokenizer` gives the text of a result (bytes unless given). The model holds
    no per-request state, so one instance can serve many interleaved requests.
    """

    def __init__(
        self,
        model: GPTConfig | CausalLM,
        seed: int = 0,
        *,
        state_dict: Mapping[str, object] | None = None,
        max_prompt_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        if isinstance(model, GPTConfig):
            lm: CausalLM = NanoGPT(model, seed)
            if state_dict is not None:
                assert isinstance(lm, NanoGPT)
                check_state_dict(lm, state_dict)
                lm.load_state_dict(state_dict, strict=True)
        elif state_dict is not None:
            raise ValueError("state_dict is for a nanoGPT built from a GPTConfig; a CausalLM comes with its weights")
        else:
            lm = model
        self.module = lm.eval().requires_grad_(False)
        self.info: ModelInfo = lm.info
        limit = self.info.max_model_len
        self.max_tokens = limit if max_prompt_tokens is None else min(limit, max_prompt_tokens)
        self.tokenizer: Tokenizer = BYTES if tokenizer is None else tokenizer
        #: The stream prefill runs on (`place`): low priority on a GPU, none on the CPU.
        self.lane = Lane.prefill(torch.device("cpu"))
        #: The stream a done prefill's head and logits' copy run on: training's priority on a GPU.
        self.finish_lane = Lane.finishing(torch.device("cpu"))
        #: Blocks replayed from CUDA graphs where shapes allow (`use_graphs`; None: every block eager).
        self.graphs: GraphedBlocks | None = None

    def place(self, device: torch.device, dtype: torch.dtype | None = None) -> PrefillModel:
        """Move the weights to `device` (cast to `dtype` if given; buffers, rotary frequencies, stay
        float32), to run on a low-priority stream of its own there (on a GPU training's kernels go
        first; `shared.model.lanes`), a done prefill's head on one as urgent as training's."""
        self.module.to(device)
        for p in self.module.parameters() if dtype is not None else ():
            p.data = p.data.to(dtype)
        self.lane, self.finish_lane = Lane.prefill(device), Lane.finishing(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # once, at set-up: the weights' copies are done before any stream reads them
        return self

    def use_graphs(self) -> PrefillModel:
        """Replay blocks from CUDA graphs where shapes allow (`shared.model.graphs`), every one
        captured now, at set-up (`capture_plan`: each layer, each bucket a prompt of up to
        `max_tokens` can use); after `place` on a GPU (`ValueError` elsewhere)."""
        dtype = next(self.module.parameters()).dtype
        self.graphs = GraphedBlocks(self.module.block, self.lane, self.info.d_model, dtype)
        self.graphs.capture(capture_plan(self.layers, self.max_tokens))
        return self

    def _block(self, layer: int, hidden: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        """One block of the prefill: graphed or eager (the same tensors)."""
        if self.graphs is None:
            return self.module.block(layer, hidden, positions, past)
        return self.graphs.run(layer, hidden, positions, past)

    @property
    def layers(self) -> int:
        return self.info.layers

    @property
    def device(self) -> torch.device:
        """Where the weights are (and so where inputs are created and every state's tensors live)."""
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, and so the hidden states' and KV caches' (a resumed state is cast to it)."""
        return next(self.module.parameters()).dtype

    @classmethod
    def from_checkpoint(cls, path: str | Path, cfg: GPTConfig, *, max_prompt_tokens: int | None = None) -> PrefillModel:
        """A nanoGPT with the weights of a full model's state_dict saved by `save_checkpoint` (or torch.save).

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
        """The model of a spec's `prefill` section, on the CPU (the caller may move `module`):

        * `checkpoint` a directory: the Hugging Face model in it (`load_causal_lm`) with its
          `tokenizer.json` (`CheckpointError` for anything missing or unsupported);
        * `checkpoint` a file: a nanoGPT of shape `model` with that state_dict (`from_checkpoint`);
        * no checkpoint: the nanoGPT of shape `model` seeded with `model.seed`.
        """
        cfg = GPTConfig.from_spec(spec.model)
        if spec.checkpoint is None:
            return cls(cfg, spec.model.seed, max_prompt_tokens=spec.max_prompt_tokens)
        if not Path(spec.checkpoint).is_dir():
            return cls.from_checkpoint(spec.checkpoint, cfg, max_prompt_tokens=spec.max_prompt_tokens)
        tokenizer = tokenizer_for(spec)  # a missing tokenizer.json fails before the weights are read
        lm = load_causal_lm(spec.checkpoint)
        if tokenizer.vocab_size > lm.info.vocab:
            raise CheckpointError(
                f"checkpoint {spec.checkpoint}: tokenizer.json has ids up to {tokenizer.vocab_size - 1}, "
                f"but the model's vocabulary has {lm.info.vocab} rows"
            )
        return cls(lm, max_prompt_tokens=spec.max_prompt_tokens, tokenizer=tokenizer)

    def start(self, tokens: Sequence[int]) -> PrefillState:
        """A fresh state for prompt `tokens`; `ValueError` if it is empty, too long or has a bad id."""
        ids = list(tokens)
        if not ids:
            raise ValueError("prompt is empty: a prefill needs at least one token")
        if len(ids) > self.max_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than this model's limit of {self.max_tokens}")
        vocab = self.info.vocab
        for pos, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {t!r} at position {pos} is not an id in 0..{vocab - 1}")
        return PrefillState(tokens=ids, layers=self.info.layers)

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
        with torch.inference_mode(), self.lane.scope():
            dev = self.device  # inputs go where the weights are
            pos = state.positions
            if pos is None or pos.device != dev:
                pos = state.positions = _upload(torch.arange(len(state.tokens), dtype=torch.long), dev)  # (T,)
            if state.hidden is None:
                ids = _upload(torch.tensor([state.tokens], dtype=torch.long), dev)  # (1, T)
                state.hidden = self.module.embed(ids, pos)  # (1, T, C)
            state.hidden = state.hidden.to(dev, self.dtype)  # a resumed snapshot arrives on the CPU (a no-op there)
            while not state.done and (max_layers is None or ran < max_layers):
                if should_stop is not None and should_stop():
                    break
                state.hidden, kv = self._block(state.next_layer, state.hidden, pos, None)  # (1, T, C)
                state.kv.append(kv)  # 2 x (1, kv_heads, T, head_dim)
                state.next_layer += 1
                ran += 1
                self.lane.pace()
            self.lane.hand_over()
        return state

    def run_piece(self, state: PrefillState, tokens: int) -> int:
        """Advance `state` by one piece: embeddings if not yet run, then the next `tokens` tokens of
        block `next_layer` (all of it when `tokens` covers the rest), the layer completing when its
        last piece ran. Returns the tokens run (0 when done). A piece attends over the layer's
        earlier pieces through their keys and values, as a decoder does over its cache, so a long
        prompt's layer becomes pieces of bounded time; the result equals the whole layer's up to
        float rounding (`tests/unit/test_prefill_pieces.py`)."""
        if tokens < 1:
            raise ValueError(f"a piece has at least 1 token, got {tokens}")
        self._check_state(state)
        if state.done:
            return 0
        T = len(state.tokens)
        if state.piece_done == 0 and tokens >= T:
            self.run_layers(state, max_layers=1)  # a whole layer: exactly the unpieced block
            return T
        with torch.inference_mode(), self.lane.scope():
            dev = self.device
            if state.hidden is None or state.positions is None:
                self.run_layers(state, max_layers=0)  # embeddings and positions
            assert state.hidden is not None and state.positions is not None
            a = state.piece_done
            b = min(T, a + tokens)
            hidden = state.hidden[:, a:b].to(dev, self.dtype)  # (1, b - a, C)
            out, kv = self._block(state.next_layer, hidden, state.positions[a:b], state.piece_kv)
            state.piece_out.append(out)
            state.piece_kv, state.piece_done = kv, b
            if b == T:  # the layer is whole
                state.hidden = torch.cat(state.piece_out, dim=1)  # (1, T, C)
                state.kv.append(kv)
                state.next_layer += 1
                state.piece_done, state.piece_out, state.piece_kv = 0, [], None
            self.lane.pace()
            self.lane.hand_over()
        return b - a

    def warm_up(self, tokens: int = 64) -> float:
        """Compute one prompt of `tokens` tokens (at most the model's limit) and drop it; returns the
        seconds it took. A process's first forward pays for its set-up (the thread pool, the
        allocator's first blocks, on a GPU the libraries' handles): 40 ms against 2 ms for the next
        ones on a 2-core CPU (2026-11-29), which a real request would otherwise pay in its first
        bubble, late. The answer is the same with or without it: the model holds no state."""
        t0 = time.perf_counter()
        n = max(1, min(tokens, self.max_tokens))
        self.prefill([i % self.info.vocab for i in range(n)])
        return time.perf_counter() - t0

    def last_logits(self, state: PrefillState) -> Tensor:
        """Final norm + head of the last prompt position of a done state: float32 (vocab,), on the
        finishing lane once the prefill lane's blocks are done (on the GPU: no host wait)."""
        if not state.done:
            raise ValueError(f"prefill not finished: {state.next_layer} of {state.layers} layers have run")
        self._check_state(state)
        assert state.hidden is not None
        with torch.inference_mode(), self.finish_lane.scope():
            last = state.hidden[:, -1, :].to(self.device)  # (1, C)
            self.finish_lane.after(self.lane, last)
            return self.module.head(last).float()  # (vocab,): sampled in float32 whatever the weights

    def finish(
        self, state: PrefillState, *, temperature: float = 0.0, seed: int | None = None, top_logprobs: int = 0
    ) -> PrefillResult:
        """The next token after the prompt of a done state (`ValueError` if not done); `state` is unchanged.

        The token is `sample(logits, temperature, seed=seed)`: the argmax at temperature 0, else a
        draw seeded by `seed` (same seed, same token; None = fresh entropy); the global RNG is never
        used. `logprob` and `top` are at temperature 1; `text` is the tokenizer's. Waits for the
        device: a worker uses `finish_async` and reads the result where waiting costs nothing.
        """
        return self.finish_async(state, temperature=temperature, seed=seed, top_logprobs=top_logprobs).result()

    def finish_async(
        self, state: PrefillState, *, temperature: float = 0.0, seed: int | None = None, top_logprobs: int = 0
    ) -> Finishing:
        """`finish` without waiting for the device: the last logits' copy to the host is launched
        behind an event, and `Finishing.result` (after `Finishing.wait`) samples and reads them."""
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
        logits, event = to_host(self.last_logits(state), self.finish_lane)  # (vocab,) float32, on its way
        return Finishing(
            logits, event, temperature, seed, top_logprobs, len(state.tokens), list(state.kv), self.tokenizer
        )

    def prefill(
        self, tokens: Sequence[int], *, temperature: float = 0.0, seed: int | None = None, top_logprobs: int = 0
    ) -> PrefillResult:
        """One uninterrupted prefill: `start`, `run_layers` to the end, `finish`."""
        state = self.run_layers(self.start(tokens))
        return self.finish(state, temperature=temperature, seed=seed, top_logprobs=top_logprobs)

    def decode_step(self, kv: Sequence[KV], token: int, position: int) -> tuple[Tensor, list[KV]]:
        """One more token through every block with the cache: its logits (vocab,) and the grown cache.

        `kv` is one (k, v) per layer covering positions ``0 .. position - 1`` (a finished prefill's
        `kv`, or the cache the last step returned; on any device: it is moved to the weights');
        `token` is the token at `position`. Returns the logits of the token after it and the cache
        covering ``0 .. position``. `kv` itself is not changed. `ValueError` if the cache does not
        fit the model, `token` is not an id, or `position` is past the model's `max_model_len`.
        """
        info = self.info
        if len(kv) != info.layers:
            raise ValueError(f"the cache has {len(kv)} layers, this model {info.layers}")
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < info.vocab:
            raise ValueError(f"token {token!r} is not an id in 0..{info.vocab - 1}")
        if not 0 <= position < info.max_model_len:
            raise ValueError(f"position {position} is outside the model's 0..{info.max_model_len - 1}")
        want = (1, info.kv_heads, position, info.head_dim)
        for i, (k, v) in enumerate(kv):
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise ValueError(
                    f"layer {i}'s cache has shapes {tuple(k.shape)}, {tuple(v.shape)}; expected {want} "
                    f"(positions 0..{position - 1})"
                )
        with torch.inference_mode():
            dev = self.device
            ids = torch.tensor([[token]], dtype=torch.long, device=dev)  # (1, 1)
            pos = torch.tensor([position], dtype=torch.long, device=dev)  # (1,)
            hidden = self.module.embed(ids, pos)  # (1, 1, C)
            grown: list[KV] = []
            for i, (k, v) in enumerate(kv):
                hidden, layer_kv = self.module.block(i, hidden, pos, (k.to(dev, self.dtype), v.to(dev, self.dtype)))
                grown.append(layer_kv)  # 2 x (1, kv_heads, position + 1, head_dim)
            return self.module.head(hidden[:, -1, :]).float(), grown

    def _check_state(self, state: PrefillState) -> None:
        """`ValueError` if `state` is inconsistent or was started by a model of another shape."""
        T, C, layers = len(state.tokens), self.info.d_model, self.info.layers
        if state.layers != layers or not 0 <= state.next_layer <= state.layers:
            raise ValueError(
                f"state is at layer {state.next_layer} of {state.layers}, but this model has {layers} layers"
            )
        if len(state.kv) != state.next_layer:
            raise ValueError(f"state has {len(state.kv)} KV entries for {state.next_layer} finished layers")
        if state.hidden is None and state.next_layer:
            raise ValueError(f"state is at layer {state.next_layer} but has no hidden state")
        if state.hidden is not None and tuple(state.hidden.shape) != (1, T, C):
            raise ValueError(f"state hidden has shape {tuple(state.hidden.shape)}, expected {(1, T, C)}")


def _upload(t: Tensor, device: torch.device) -> Tensor:
    """CPU tensor `t` on `device`: on a GPU from pinned memory without blocking the host (ordered
    on the current stream before whatever reads it); elsewhere `t` itself."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def save_checkpoint(model: PrefillModel | StageModule, path: str | Path) -> None:
    """torch.save the full model's state_dict to `path`, atomically (a temporary file, then rename)."""
    module = model.module if isinstance(model, PrefillModel) else model
    if not isinstance(module, StageModule):
        raise ValueError(f"only the nanoGPT is saved as a state_dict file, not a {type(module).__name__}")
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
