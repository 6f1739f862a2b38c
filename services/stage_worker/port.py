"""A stage worker's port: the one object that moves every tensor the stage sends, receives or keeps
outside its own memory. The runner, the fill executor and the reporting code call it and nothing
below it (no `DataPlane`, `shared.dataplane.kvstore`, `CheckpointStore` or Redis writes of tensors).

What it owns, and where each goes (docs/architecture.md, "Where each tensor lives"):

* **training's tensors** (`send`, the inbox handlers `on_ready` / `on_grant`, `release`): the
  activations and gradients to and from the pipeline neighbours, and their WAN grants, on the data
  plane (`transport.py`; the bus carries only their announcements), with the pool their receive
  buffers come from;
* **the collectives** (`all_reduce_mean`, `sum_tied`, `sum_norms`): the DP all-reduce of the stage's
  gradients, and the replica's cross-stage sums (the tied embedding's gradient, the global gradient
  norm), on the data plane's groups;
* **the stage's saved state** (`save_checkpoint`, `load_checkpoint`, `checkpoint_iterations`,
  `hand_over`): the recovery checkpoints and the state handed over for `bubbletea train --save`
  (`port_state.py`);
* **prefill's tensors** (`put_kv`, `save_snapshot`, `load_snapshot`): finished KV caches out, and
  the snapshots of preempted prefills out and in (`port_prefill.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.stage_worker.port_prefill import ELSEWHERE, LOST, KvStored, PrefillPort, Saved
from services.stage_worker.port_state import StatePort
from services.stage_worker.transport import Transport, stages_group, tie_group
from shared.bus import Delivery
from shared.dataplane import in_thread, kvstore
from shared.model.prefill import KV, PrefillState

__all__ = ["ELSEWHERE", "LOST", "KvStored", "PrefillPort", "Saved", "StagePort", "StatePort"]


@dataclass
class StagePort:
    """One per stage worker. `transport` (training's tensors and collectives) and `state` (its
    checkpoints and saves) are None in a port that only serves prefill (the fill executor's tests);
    `prefill` is always there."""

    prefill: PrefillPort
    transport: Transport | None = None
    state: StatePort | None = None

    # --- training's tensors: point to point ----------------------------------------------------

    def _tx(self) -> Transport:
        assert self.transport is not None, "this port carries no training tensors"
        return self.transport

    async def form(self, generation: int) -> None:
        """This generation's data-plane groups, with every peer (blocks until they all come)."""
        await self._tx().form(generation)

    def reset(self) -> None:
        """A new generation: forget what the cut-short one had under way."""
        if self.transport is not None:
            self.transport.reset()

    def send(self, what: str, it: int, mb: int, tensor: torch.Tensor, dst: int) -> None:
        """Put an activation or gradient for stage `dst` on its way (never blocks the schedule)."""
        self._tx().send(what, it, mb, tensor, dst)

    def release(self, buf: torch.Tensor) -> None:
        """A received tensor is dead (its backward ran): its buffer goes back to the receive pool."""
        self._tx().plane.release(buf)

    async def on_ready(self, d: Delivery) -> None:
        """The inbox handler of `TensorReady`: receive the announced tensor into the mailbox."""
        await self._tx().on_ready(d)

    async def on_grant(self, d: Delivery) -> None:
        """The inbox handler of `SlotGrant`: a WAN slot for one of our sends."""
        await self._tx().on_grant(d)

    @property
    def failed(self) -> asyncio.Event:
        """Set when the data plane failed in this generation (a peer died mid-transfer)."""
        return self._tx().failed

    @property
    def error(self) -> str:
        return self._tx().error

    async def flush(self, timeout_s: float) -> bool:
        """Wait for the sends under way; whether they all finished in time."""
        return True if self.transport is None else await self.transport.flush(timeout_s)

    async def close(self) -> None:
        """Training's tensors: let the sends under way finish, then drop the data plane's groups."""
        if self.transport is not None:
            await self.transport.close()

    # --- training's tensors: collectives -------------------------------------------------------

    async def all_reduce_mean(self, flat: torch.Tensor, t0: float) -> tuple[torch.Tensor, float]:
        """The DP mean of the stage's flat gradients (CPU), and when the last replica reached it
        (wall clock, `t0` this one's arrival). Raises `PlaneError` if a peer is lost."""
        return await in_thread(self._tx().plane.all_reduce_mean, flat, t0)

    async def sum_tied(self, replica: int, grad: torch.Tensor) -> torch.Tensor:
        """The tied embedding's gradient summed over the replica's first and last stage."""
        return await in_thread(self._tx().plane.all_reduce_sum, tie_group(replica), grad)

    async def sum_norms(self, replica: int, sq: torch.Tensor) -> torch.Tensor:
        """The squared gradient norms summed over every stage of the replica (global clipping)."""
        return await in_thread(self._tx().plane.all_reduce_sum, stages_group(replica), sq)

    # --- the stage's saved state ---------------------------------------------------------------

    def _st(self) -> StatePort:
        assert self.state is not None, "this port keeps no training state"
        return self.state

    @property
    def checkpoints(self) -> bool:
        """Whether this stage checkpoints (`training.checkpoint_every`)."""
        return self.state is not None and self.state.checkpoints is not None

    async def save_checkpoint(self, iteration: int, blob: bytes) -> None:
        await self._st().save_checkpoint(iteration, blob)

    async def load_checkpoint(self, iteration: int) -> bytes:
        return await self._st().load_checkpoint(iteration)

    async def checkpoint_iterations(self) -> dict[str, list[int]]:
        """Which iterations every slot of the run has a checkpoint of."""
        return await self._st().checkpoint_iterations()

    async def hand_over(self, iteration: int, weights: bytes, state: bytes) -> None:
        """`bubbletea train --save`: this stage's weights and trainer state after `iteration`, for
        the launcher to write the save directory from."""
        await self._st().hand_over(iteration, weights, state)

    # --- prefill's tensors ---------------------------------------------------------------------

    async def put_kv(
        self, request_id: str, model: str, prompt: Sequence[int], first_token: int, kv: list[KV], now: float
    ) -> KvStored:
        """Keep a finished prefill's KV cache (in the format decoders read, `shared.dataplane.kvstore.kv_file`)
        for decoders to fetch."""
        return await self.prefill.put_kv(request_id, kvstore.kv_file(request_id, model, prompt, first_token, kv), now)

    async def save_snapshot(self, request_id: str, layer: int, state: PrefillState) -> bool:
        """Keep a preempted prefill's state at `layer` for whichever worker resumes it (False: the
        snapshot budget is full, it was not kept)."""
        return await self.prefill.save_snapshot(request_id, layer, state)

    async def load_snapshot(self, handle: str, layers: int) -> Saved:
        """The state a resumed item continues from (None: its handle expired; `LOST`: its holder is
        gone, the item starts again from its prompt)."""
        return await self.prefill.load_snapshot(handle, layers)

    async def close_prefill(self) -> None:
        """Prefill's tensors: stop serving this worker's snapshots (last: they die with the worker)."""
        await self.prefill.close()
