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
  (`state.py`);
* **prefill's tensors** (`keep_prefills`, `load_snapshot`): finished KV caches out, and
  the snapshots of preempted prefills out and in (`prefill.py`).

Tested by: tests/integration/test_fill_executor.py, tests/integration/test_kv_budget.py,
tests/integration/test_prefill_profile.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from services.stage_worker.membership.lease import Slot
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.outbox import Outbox
from services.stage_worker.port.prefill import ELSEWHERE, LOST, KvStored, PrefillPort, Saved, encode_snapshot
from services.stage_worker.port.state import CheckpointStore, StatePort
from services.stage_worker.port.tensors import Direction
from services.stage_worker.port.transport import Transport, stages_group, tie_group
from shared.bus import Delivery
from shared.config.settings import Settings
from shared.dataplane import DataPlane, in_thread, kvstore
from shared.model.prefill import KV, PrefillState
from shared.policies.pipeline_plan import dispatch_dc
from shared.policies.placement import Placement
from shared.wire import keys

__all__ = ["ELSEWHERE", "LOST", "Cut", "Finished", "KvStored", "PrefillPort", "Saved", "StagePort", "StatePort"]


@dataclass(frozen=True)
class Finished:
    """A finished prefill whose KV cache is to be kept."""

    request_id: str
    prompt: Sequence[int]
    first_token: int
    kv: list[KV]


@dataclass(frozen=True)
class Cut:
    """A prefill stopped part way whose state is to be kept for its resumption."""

    request_id: str
    state: PrefillState


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

    def send(self, direction: Direction, it: int, mb: int, tensor: torch.Tensor, dst: int) -> None:
        """Put an activation or gradient for stage `dst` on its way (never blocks the schedule)."""
        self._tx().send(direction, it, mb, tensor, dst)

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

    async def share_state(self, blob: bytes | None, source_replica: int) -> bytes:
        """The stage's state handed over by its live DP peer `source_replica` (which passes its
        `blob`; every other worker of the stage passes None and gets it): a lost peer's recovery,
        over the data plane's DP group, not through a file."""
        return await in_thread(self._tx().plane.broadcast_dp, blob, source_replica)

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

    async def keep_prefills(
        self, model: str, finished: Sequence[Finished], cut: Sequence[Cut], now: float
    ) -> tuple[dict[str, KvStored], list[tuple[str, str]]]:
        """After a batch, off the training path: the finished prefills' KV caches kept for
        decoders (in the format they read, `shared.dataplane.kvstore.kv_file`), and the cut ones'
        states shelved for whichever worker resumes them. Every tensor is copied into bytes in a
        thread, not on the event loop. Returns each kept cache by request id, and the snapshot
        handles to write (key, value; one not kept for lack of budget has none), for the caller
        to write with its answers in one round trip."""

        def encode() -> tuple[list[bytes], list[bytes]]:
            files = [kvstore.kv_file(f.request_id, model, f.prompt, f.first_token, f.kv) for f in finished]
            snaps = [encode_snapshot(c.request_id, c.state) for c in cut]
            return files, snaps

        files, snaps = await asyncio.to_thread(encode)
        stored = {
            f.request_id: await self.prefill.put_kv(f.request_id, data, now)
            for f, data in zip(finished, files, strict=True)
        }
        handles = []
        for c, data in zip(cut, snaps, strict=True):
            handle = await self.prefill.shelve_snapshot(c.request_id, c.state.next_layer, data)
            if handle is not None:
                handles.append(handle)
        return stored, handles

    async def save_snapshot(self, request_id: str, layer: int, state: PrefillState) -> bool:
        """Keep one preempted prefill's state at `layer` now, its handle written (False: the
        snapshot budget is full, it was not kept)."""
        return await self.prefill.save_snapshot(request_id, layer, state)

    def write_handles(self, pipe: Pipeline, handles: Sequence[tuple[str, str]]) -> None:
        """Queue on `pipe` the handles `keep_prefills` returned (each with the snapshots' TTL)."""
        for key, value in handles:
            pipe.set(key, value, ex=keys.PREFILL_SNAPSHOT_TTL_S)

    async def load_snapshot(self, handle: str, layers: int) -> Saved:
        """The state a resumed item continues from (None: its handle expired; `LOST`: its holder is
        gone, the item starts again from its prompt)."""
        return await self.prefill.load_snapshot(handle, layers)

    async def close_prefill(self) -> None:
        """Prefill's tensors: stop serving this worker's snapshots (last: they die with the worker)."""
        await self.prefill.close()


def build_port(
    redis: Redis,
    settings: Settings,
    placement: Placement,
    slot: Slot,
    slots: Sequence[Slot],
    plane: DataPlane,
    outbox: Outbox,
    mailbox: Mailbox,
    generation: Callable[[], int],
    *,
    tied: bool,
) -> StagePort:
    """The port of `slot`'s worker: training's tensors on `plane` (announced on `outbox`, received
    into `mailbox`, stamped with the run's current `generation`; `tied`: the stage holds a tied
    embedding), its saved state (checkpoints where the run recovers; every slot's in `slots`), and
    prefill's tensors."""
    spec, run = settings.spec, settings.run
    transport = Transport(outbox, plane, spec, run, slot, placement, mailbox, generation=generation, tied=tied)
    state_dir = settings.state_dir
    checkpoints = CheckpointStore(redis, run, slots, state_dir) if spec.training.recovers else None
    prefill = PrefillPort(
        redis,
        run,
        spec.prefill.kv_ttl_s,
        spec.prefill.kv_budget_mb << 20,
        host=plane.addresses[0],
        dc=placement.stage_dc[slot.stage],
        dispatch_dc=dispatch_dc(spec, slot.stage),
    )
    return StagePort(prefill, transport, StatePort(redis, run, slot, state_dir, checkpoints))
