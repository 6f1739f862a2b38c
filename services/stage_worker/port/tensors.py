"""How the stage's tensors are named and held: a direction along the pipeline (`Direction`), a key
per received tensor (`TensorKey`, the mailbox's and the transport's), and one cache per direction
for the tensors of the iteration the runner walks (`DirectionCache`, `IterationTensors`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shared.wire import TensorReady


class Direction(enum.StrEnum):
    """Which way a tensor goes along the pipeline (a `TensorReady`'s `what` on the wire)."""

    ACT = "act"  # an activation, stage k -> k+1
    GRAD = "grad"  # its gradient, stage k+1 -> k


class TensorKey(NamedTuple):
    """One tensor a slot receives: its direction, iteration and microbatch."""

    direction: Direction
    iteration: int
    microbatch: int

    @classmethod
    def of(cls, m: TensorReady) -> TensorKey:
        """The key of the tensor `m` announces."""
        return cls(Direction(m.what), m.iteration, m.microbatch)


@dataclass
class DirectionCache:
    """One direction's tensors in one iteration, by microbatch: the one received (the input its
    compute takes: the forward an activation, the backward a gradient) and the one that compute
    produced, until it is sent on in the same direction."""

    direction: Direction
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # received, until its compute takes it
    #: received, a data-plane buffer: back to the pool once the microbatch's backward ran
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # computed, until sent

    def received(self, mb: int, tensor: torch.Tensor) -> None:
        self.inputs[mb] = self.buffers[mb] = tensor

    def take_input(self, mb: int) -> torch.Tensor | None:
        """The input of microbatch `mb`'s compute (None: none comes this way, as at the first stage)."""
        return self.inputs.pop(mb, None)

    def computed(self, mb: int, tensor: torch.Tensor | None) -> None:
        if tensor is not None:  # (none goes on from the last stage's forward, nor the first's backward)
            self.outputs[mb] = tensor

    def take_output(self, mb: int) -> torch.Tensor:
        return self.outputs.pop(mb)

    def dead_buffer(self, mb: int) -> torch.Tensor | None:
        """Microbatch `mb`'s received buffer, now dead (its backward ran), if it had one."""
        return self.buffers.pop(mb, None)


@dataclass
class IterationTensors:
    """The tensors of one iteration, one cache per direction."""

    act: DirectionCache = field(default_factory=lambda: DirectionCache(Direction.ACT))
    grad: DirectionCache = field(default_factory=lambda: DirectionCache(Direction.GRAD))

    def __getitem__(self, direction: Direction) -> DirectionCache:
        return self.act if direction is Direction.ACT else self.grad
