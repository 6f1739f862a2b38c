"""CUDA graphs of prefill blocks (`bubbletea.cuda_graphs`, off by default): a block replayed as one
launch instead of the dozens of kernels its Python code launches one by one.

A graph has fixed shapes, so it is captured per (layer, token bucket) where shapes allow: a block
with no earlier pieces to attend over (a whole layer of a prompt of at most the largest bucket, or
the first piece of a longer prompt's layer), its tokens padded at the end to the next bucket.
Attention is causal, so the padding changes nothing for the real tokens: their outputs and keys and
values are the eager block's (up to the rounding of another kernel for another shape,
`tests/unit/test_streams.py` pins it on a GPU), sliced off the padded ones and copied out of the
graph's buffers. A later piece of a long prompt attends over a cache whose length changes piece by
piece: it runs eagerly.

Graphs are captured lazily, the first time a (layer, bucket) runs, on the prefill lane's stream; a
capture that fails (an operation the graph cannot hold) leaves that block eager for good, logged
once. Off by default: whether they pay depends on the device and the model (a block of a large
model on a GPU is a few large kernels whose launch costs nothing next to them), measured by
`bench/prefill_graphs.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from shared.model.causal import KV
from shared.model.streams import Lane
from shared.runtime.logs import get_logger

log = get_logger(__name__)

#: Token buckets: a block of n tokens replays the graph of the smallest bucket >= n.
BUCKETS = (16, 32, 64, 128, 256)
#: Runs before a capture, on the capture's stream (CUDA graphs need their kernels' first-run
#: set-up, e.g. cuBLAS workspaces, done outside the capture).
WARMUP_RUNS = 2


def bucket(tokens: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket that holds `tokens` (None: longer than the largest)."""
    return next((b for b in buckets if b >= tokens), None)


Block = Callable[[int, Tensor, Tensor, KV | None], tuple[Tensor, KV]]


class _Captured:
    """One (layer, bucket)'s graph and its static buffers."""

    def __init__(self, block: Block, layer: int, hidden: Tensor, positions: Tensor, stream: torch.cuda.Stream) -> None:
        self.hidden, self.positions = hidden, positions  # the inputs' buffers, (1, bucket, C) and (bucket,)
        self.graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                block(layer, self.hidden, self.positions, None)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, stream=stream):
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
        return self.out[:, :n].clone(), (self.k[:, :, :n].clone(), self.v[:, :, :n].clone())

    def _pad_offsets(self, n: int) -> Tensor:
        return torch.arange(self.positions.shape[0] - n, device=self.positions.device)


class GraphedBlocks:
    """The graphed blocks of one prefill model on one lane (a GPU's)."""

    def __init__(self, block: Block, lane: Lane, width: int, dtype: torch.dtype, buckets: tuple[int, ...] = BUCKETS):
        if lane.stream is None:
            raise ValueError("CUDA graphs need a GPU: this lane has no CUDA stream")
        self.block, self.lane, self.width, self.dtype, self.buckets = block, lane, width, dtype, buckets
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._eager: set[tuple[int, int]] = set()  # captures that failed: eager for good
        self._capture_stream = torch.cuda.Stream(device=lane.device)

    def captured(self) -> int:
        """How many (layer, bucket) graphs were captured so far."""
        return len(self._graphs)

    def run(self, layer: int, hidden: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        """Block `layer` on `hidden` (1, n, C) at `positions` (n,): graphed where shapes allow (no
        `past`, n within a bucket), else eagerly; the same (out, (k, v)) either way."""
        b = bucket(hidden.shape[1], self.buckets)
        if past is not None or b is None or (layer, b) in self._eager:
            return self.block(layer, hidden, positions, past)
        graphed = self._graphs.get((layer, b)) or self._capture(layer, b)
        if graphed is None:
            return self.block(layer, hidden, positions, past)
        return graphed.run(hidden, positions)

    def _capture(self, layer: int, bucket: int) -> _Captured | None:
        dev = self.lane.device
        hidden = torch.zeros(1, bucket, self.width, dtype=self.dtype, device=dev)
        positions = torch.arange(bucket, dtype=torch.long, device=dev)
        try:
            captured = _Captured(self.block, layer, hidden, positions, self._capture_stream)
        except RuntimeError as exc:  # an operation a graph cannot hold: this block stays eager
            log.warning("a prefill block cannot be graphed: eager", layer=layer, bucket=bucket, error=str(exc))
            self._eager.add((layer, bucket))
            return None
        self._graphs[(layer, bucket)] = captured
        return captured
