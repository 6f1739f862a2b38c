"""CUDA graphs of prefill blocks (`bubbletea.cuda_graphs`, off by default): a block replayed as one
launch instead of the dozens of kernels its Python code launches one by one.

A graph has fixed shapes, so it is captured per (layer, token bucket) where shapes allow: a block
with no earlier pieces to attend over (a whole layer of a prompt of at most the largest bucket, or
the first piece of a longer prompt's layer), its tokens padded at the end to the next bucket.
Attention is causal, so the padding changes nothing for the real tokens: their outputs and keys and
values are the eager block's (up to the rounding of another kernel for another shape,
`tests/unit/test_prefill_pieces.py` pins it on a GPU), sliced off the padded ones and copied out of
the graph's buffers. A later piece of a long prompt attends over a cache whose length changes piece
by piece: it runs eagerly.

CUDA's rules for graphs, as PyTorch's CUDA semantics notes give them:

* **Captured at set-up, never in a bubble.** A capture synchronizes the whole device and empties
  the caching allocator, so one inside a bubble would stall training. `PrefillModel.use_graphs`
  (as the worker builds its guest model, before training's first step) captures every (layer,
  bucket) a prompt of at most the model's `max_tokens` can replay (`capture_plan`). At run time a
  block only looks its graph up (`graph_for`): one whose bucket has none (its capture failed, or
  a shape outside the buckets) runs eagerly; nothing is captured after set-up.
* **`thread_local` capture mode.** In the default `global` mode, CUDA calls that are unsafe during
  a capture fail in every thread while one is under way; `thread_local` confines that to the
  capturing thread, so another thread using the device (training's) never fails because of it.
* **One memory pool for all graphs** (`torch.cuda.graph_pool_handle`), not one each. Sharing is
  safe here because the graphs replay one at a time, in order, on the prefill lane's stream, and
  each replay's outputs are copied out of the pool before the next replay can overwrite them.

Off by default: whether graphs pay depends on the device and the model (a block of a large model on
a GPU is a few large kernels whose launch costs nothing next to them), measured by
`bench/prefill_graphs.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import torch
from torch import Tensor

from shared.model.causal import KV
from shared.model.lanes import Lane
from shared.runtime.logs import get_logger

log = get_logger(__name__)

#: Token buckets: a block of n tokens replays the graph of the smallest bucket >= n.
BUCKETS = (16, 32, 64, 128, 256)
#: Runs before a capture, on the capture's stream (CUDA graphs need their kernels' first-run
#: set-up, e.g. cuBLAS workspaces, done outside the capture).
WARMUP_RUNS = 2

G = TypeVar("G")


def bucket(tokens: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket that holds `tokens` (None: longer than the largest)."""
    return next((b for b in buckets if b >= tokens), None)


def capture_plan(layers: int, max_tokens: int, buckets: tuple[int, ...] = BUCKETS) -> tuple[tuple[int, int], ...]:
    """Every (layer, bucket) that a block with no earlier pieces can replay when prompts have at
    most `max_tokens` tokens: in each layer, every bucket up to the one that holds `max_tokens`
    (all of them when longer prompts' first pieces can fill the largest). Captured at set-up."""
    top = bucket(max_tokens, buckets) or buckets[-1]
    return tuple((layer, b) for layer in range(layers) for b in buckets if b <= top)


def graph_for(
    graphs: Mapping[tuple[int, int], G], layer: int, tokens: int, *, past: bool, buckets: tuple[int, ...] = BUCKETS
) -> G | None:
    """The graph block `layer` replays for `tokens` new tokens, or None (eager): where it attends
    over earlier pieces (`past`), no bucket holds it, or its bucket has no graph. Only looks up."""
    b = bucket(tokens, buckets)
    return None if past or b is None else graphs.get((layer, b))


Block = Callable[[int, Tensor, Tensor, KV | None], tuple[Tensor, KV]]


class _Captured:
    """One (layer, bucket)'s graph and its static buffers."""

    def __init__(
        self,
        block: Block,
        layer: int,
        hidden: Tensor,
        positions: Tensor,
        stream: torch.cuda.Stream,
        pool: torch.cuda._POOL_HANDLE,
    ) -> None:
        self.hidden, self.positions = hidden, positions  # the inputs' buffers, (1, bucket, C) and (bucket,)
        self.graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                block(layer, self.hidden, self.positions, None)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.out, (self.k, self.v) = block(layer, self.hidden, self.positions, None)

    def run(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, KV]:
        n = hidden.shape[1]
        self.hidden[:, :n].copy_(hidden)
        self.hidden[:, n:].zero_()
        self.positions[:n].copy_(positions)
        # the padding's positions follow the prompt's (any valid position would do: causal attention
        # keeps them from the real tokens)
        self.positions[n:].copy_(positions[-1] + 1 + self._pad_offsets(n))
        self.graph.replay()
        # copied out of the shared pool before any other graph replays over it
        return self.out[:, :n].clone(), (self.k[:, :, :n].clone(), self.v[:, :, :n].clone())

    def _pad_offsets(self, n: int) -> Tensor:
        return torch.arange(self.positions.shape[0] - n, device=self.positions.device)


class GraphedBlocks:
    """The graphed blocks of one prefill model on one lane (a GPU's): `capture` at set-up, then `run`."""

    def __init__(self, block: Block, lane: Lane, width: int, dtype: torch.dtype, buckets: tuple[int, ...] = BUCKETS):
        if lane.stream is None:
            raise ValueError("CUDA graphs need a GPU: this lane has no CUDA stream")
        self.block, self.lane, self.width, self.dtype, self.buckets = block, lane, width, dtype, buckets
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()  # one pool, every graph's

    def captured(self) -> int:
        """How many (layer, bucket) graphs were captured."""
        return len(self._graphs)

    def capture(self, plan: Iterable[tuple[int, int]]) -> int:
        """At set-up, before training's first step: capture each (layer, bucket) of `plan`
        (`capture_plan`); one that fails (an operation a graph cannot hold) stays eager, logged.
        Returns how many graphs there are."""
        dev = self.lane.device
        stream = torch.cuda.Stream(device=dev)
        with torch.inference_mode():  # the buffers are inference tensors, as the blocks' inputs are
            for layer, b in plan:
                hidden = torch.zeros(1, b, self.width, dtype=self.dtype, device=dev)
                positions = torch.arange(b, dtype=torch.long, device=dev)
                try:
                    self._graphs[(layer, b)] = _Captured(self.block, layer, hidden, positions, stream, self._pool)
                except RuntimeError as exc:
                    log.warning("a prefill block cannot be graphed: eager", layer=layer, bucket=b, error=str(exc))
        torch.cuda.synchronize(dev)  # once, at set-up: every capture's buffers are ready before a replay
        return self.captured()

    def run(self, layer: int, hidden: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        """Block `layer` on `hidden` (1, n, C) at `positions` (n,): replayed where a graph was
        captured for it (`graph_for`), else eagerly; the same (out, (k, v)) either way."""
        graphed = graph_for(self._graphs, layer, hidden.shape[1], past=past is not None, buckets=self.buckets)
        if graphed is None:
            return self.block(layer, hidden, positions, past)
        return graphed.run(hidden, positions)
