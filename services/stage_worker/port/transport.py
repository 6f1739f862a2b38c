"""A worker's tensors on the data plane, with their control messages on the bus.

Sending an activation or gradient (`send`, never blocking the schedule):

* same DC: the bytes go on the pair's connection at once, and a `TensorReady` tells the receiver
  to take them;
* another DC, `wan.mode: model`: the same, but the receiver holds the tensor (`hold`) until the
  broker, which got a `Transfer` of the tensor's size stamped with the send time, releases it at
  the arrival time of its link model;
* another DC, `kernel` or `none`: a `SlotRequest` to the broker first; on its `SlotGrant` the bytes
  go, chunked over the link's `connections`, and the receiver's `SlotDone` frees the slot once
  the last byte has landed (not the sender's: its send returns when the bytes are in the socket
  buffer, seconds ahead of the wire on a slow link).

Receiving (`on_ready`, the inbox handler of `TensorReady`): post the receive for the announced
tensor, and put it in the mailbox once it has landed (and, if held, once released). A tensor of
another generation is drained if this worker still has that generation's groups, else dropped.

A data-plane failure in the current generation (a peer died mid-transfer) sets `failed`; the
runner waits a lease's lifetime for the recovery path to take over before giving up.

Tested by: tests/e2e/test_training_correctness.py, tests/e2e/test_multihost.py,
tests/e2e/test_recovery_formation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from services.stage_worker.membership.lease import Slot
from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.outbox import Outbox, wan_transfer
from services.stage_worker.port.tensors import Direction, TensorKey
from shared.bus import Delivery, Reject
from shared.config.settings import Settings
from shared.config.spec import ClusterSpec
from shared.control.leases import slot_name
from shared.dataplane import DataPlane, GroupSpec, PairSpec, PlaneError, in_thread, tag_of
from shared.dataplane.tensors import dtype_name, torch_dtype
from shared.policies.placement import Placement
from shared.policies.wan import transfer_priority
from shared.runtime.logs import get_logger
from shared.wire import SlotDone, SlotGrant, SlotRequest, TensorReady, keys

log = get_logger(__name__)

#: How long a stopping worker waits for its sends under way to be taken by their receivers.
CLOSE_GRACE_S = 5.0
#: How long a worker that finished training waits for its last sends: on a shared WAN link a
#: send may first wait for its slot behind the other transfers.
FINISH_GRACE_S = 60.0


def plane_addresses(settings: Settings, slot: Slot, placement: Placement) -> list[str]:
    """The local addresses this worker's groups bind, one per connection index: the host's
    (`BUBBLETEA_PLANE_HOST`) in modes `model` and `none`; in `kernel` mode the addresses its
    DC's namespace gives this slot, one per connection, so the kernel shapes each connection."""
    spec = settings.spec
    if spec.wan.mode != "kernel":
        return [settings.plane_host]
    from shared.dataplane.kernel_net import plan_kernel_net, run_base

    plan = plan_kernel_net(spec, settings.run, base=run_base(settings.run))
    dc = placement.stage_dc[slot.stage]
    return plan.worker_addresses(dc, plan.local_index(spec, slot.replica, slot.stage))


def pairs_of(spec: ClusterSpec, placement: Placement, slot: Slot) -> list[PairSpec]:
    """This slot's pairs with its pipeline neighbours: a cross-DC pair has its link's
    `connections` where real links carry the bytes (`kernel`, `none`), a same-DC pair one.

    In `model` mode a cross-DC pair has one connection too: the link model already accounts for
    the connections (its per-transfer cap), the bytes cross loopback, and cutting every tensor
    into `connections` pieces only costs CPU (measured on the demo: the stage workers' CPU time
    rose by 29% with 8, which slowed training under BubbleTea's load on 2 cores)."""
    r, k, pp = slot.replica, slot.stage, spec.parallelism.pp
    pairs = []
    for lo in (k - 1, k):
        hi = lo + 1
        if lo < 0 or hi >= pp:
            continue
        a, b = placement.stage_dc[lo], placement.stage_dc[hi]
        conns = 1 if a == b or spec.wan.mode == "model" else spec.link(a, b).connections
        peer = hi if lo == k else lo
        pairs.append(PairSpec(slot_name(r, peer), f"r{r}:s{lo}-s{hi}", 0 if lo == k else 1, conns))
    return pairs


def dp_group_of(spec: ClusterSpec, slot: Slot) -> GroupSpec:
    return GroupSpec(f"dp:s{slot.stage}", slot.replica, spec.parallelism.dp)


def tie_group(replica: int) -> str:
    return f"tie:r{replica}"


def stages_group(replica: int) -> str:
    return f"stages:r{replica}"


def pipeline_groups_of(spec: ClusterSpec, slot: Slot, tied: bool) -> list[GroupSpec]:
    """The replica's own collectives across its stages: the tied embedding's gradient sum between
    the first and the last stage (`tied`: the model ties its head to the embedding), and the sum
    of the stages' squared gradient norms (clipping by the global norm). None with one stage."""
    pp, groups = spec.parallelism.pp, []
    if pp == 1:
        return []
    if tied and slot.stage in (0, pp - 1):
        groups.append(GroupSpec(tie_group(slot.replica), 0 if slot.stage == 0 else 1, 2))
    if spec.training.clip_grad_norm > 0:
        groups.append(GroupSpec(stages_group(slot.replica), slot.stage, pp))
    return groups


@dataclass
class Transport:
    outbox: Outbox
    plane: DataPlane
    spec: ClusterSpec
    run: str
    slot: Slot
    placement: Placement
    mailbox: Mailbox
    generation: Callable[[], int]
    #: Whether this stage holds an embedding tied across the first and the last stage.
    tied: bool = False
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set once this generation's groups exist: an announcement from a peer that formed its end
    #: first waits for ours (its receive needs our groups).
    formed: asyncio.Event = field(default_factory=asyncio.Event)
    error: str = ""
    _posted: set[TensorKey] = field(default_factory=set)  # this generation's (reset clears it)
    _landed: dict[TensorKey, torch.Tensor] = field(default_factory=dict)  # held for their WAN release
    _released: set[TensorKey] = field(default_factory=set)
    _grants: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    _tasks: set[asyncio.Future[Any]] = field(default_factory=set)

    @property
    def mode(self) -> str:
        return self.spec.wan.mode

    async def form(self, generation: int) -> None:
        """Build this generation's groups, with every peer (in a thread: it blocks until they come).
        Cancelled (the worker stops meanwhile), the thread stops waiting for them too: a thread
        still waiting would hold the worker's exit up to the plane's timeout."""
        pairs, dp = pairs_of(self.spec, self.placement, self.slot), dp_group_of(self.spec, self.slot)
        groups = pipeline_groups_of(self.spec, self.slot, self.tied)
        called_off = threading.Event()
        try:
            await asyncio.to_thread(self.plane.form, generation, pairs, dp, groups, called_off)
        except asyncio.CancelledError:
            called_off.set()
            raise
        if generation == self.generation():
            self.formed.set()

    def reset(self) -> None:
        """A new generation: forget what the cut-short one had under way."""
        self._posted.clear()
        self._landed.clear()
        self._released.clear()
        for fut in self._grants.values():
            fut.cancel()
        self._grants.clear()
        self.failed.clear()
        self.formed.clear()
        self.error = ""

    # --- sending ---------------------------------------------------------------------------

    def send(self, direction: Direction, it: int, mb: int, tensor: torch.Tensor, dst: int) -> None:
        what = direction.value
        gen = self.generation()
        src_dc, dst_dc = self.placement.stage_dc[self.slot.stage], self.placement.stage_dc[dst]
        ready = TensorReady(
            run=self.run,
            what=what,
            iteration=it,
            microbatch=mb,
            replica=self.slot.replica,
            src_stage=self.slot.stage,
            dst_stage=dst,
            dtype=dtype_name(tensor.dtype),
            shape=tuple(tensor.shape),
            generation=gen,
            hold=src_dc != dst_dc and self.mode == "model",
        )
        inbox = keys.inbox(self.run, self.slot.replica, dst)
        peer = slot_name(self.slot.replica, dst)
        if src_dc == dst_dc or self.mode == "model":
            self._track(self._transmit(gen, peer, tensor, tag_of(what, it, mb)))
            self.outbox.send(inbox, ready)
            if ready.hold:
                transfer_id = f"{what}:{gen}:{it}:{mb}:{self.slot.replica}:{self.slot.stage}"
                priority = transfer_priority(it, mb, self.slot.replica)
                release = msgspec.structs.replace(ready, hold=False, release=True)
                nbytes = tensor.numel() * tensor.element_size()
                transfer = wan_transfer(self.run, release, transfer_id, src_dc, dst_dc, inbox, priority, nbytes)
                self.outbox.send(keys.wan_stream(self.run), transfer)
            return
        self._track(self._granted_send(ready, gen, peer, tensor, src_dc, dst_dc, inbox))

    async def _transmit(self, gen: int, peer: str, tensor: torch.Tensor, tag: int) -> bool:
        """Send on the data plane; False (the failure recorded) if the peer is gone."""
        try:
            await in_thread(self.plane.send, gen, peer, tensor, tag)
        except PlaneError as exc:
            self._fail(gen, exc)
            return False
        return True

    async def _granted_send(
        self, ready: TensorReady, gen: int, peer: str, tensor: torch.Tensor, src_dc: str, dst_dc: str, inbox: str
    ) -> None:
        """Ask the broker for the link, send on grant, free the slot (`kernel` / `none`)."""
        transfer_id = f"{ready.what}:{gen}:{ready.iteration}:{ready.microbatch}:{self.slot.replica}:{self.slot.stage}"
        granted = self._grants.setdefault(transfer_id, asyncio.get_running_loop().create_future())
        asked = time.time()
        self.outbox.send(
            keys.wan_stream(self.run),
            SlotRequest(
                run=self.run,
                transfer_id=transfer_id,
                src_dc=src_dc,
                dst_dc=dst_dc,
                nbytes=tensor.numel() * tensor.element_size(),
                priority=transfer_priority(ready.iteration, ready.microbatch, self.slot.replica),
                microbatch=ready.microbatch,
                what=ready.what,
                reply_to=keys.inbox(self.run, self.slot.replica, self.slot.stage),
                sent_at=asked,
            ),
        )
        await granted
        self._grants.pop(transfer_id, None)
        self.outbox.send(inbox, msgspec.structs.replace(ready, slot=transfer_id))
        if not await self._transmit(gen, peer, tensor, tag_of(ready.what, ready.iteration, ready.microbatch)):
            self._slot_done(transfer_id, src_dc, dst_dc, 0.0)  # the receiver will not report: free it here

    def _slot_done(self, transfer_id: str, src_dc: str, dst_dc: str, seconds: float) -> None:
        done = SlotDone(run=self.run, transfer_id=transfer_id, src_dc=src_dc, dst_dc=dst_dc, seconds=seconds)
        self.outbox.send(keys.wan_stream(self.run), done)

    def _landed_slot(self, m: TensorReady, seconds: float = 0.0) -> None:
        """The receiver's end of a granted transfer: its last byte is here (or it never will be)."""
        if m.slot:
            src_dc, dst_dc = self.placement.stage_dc[m.src_stage], self.placement.stage_dc[m.dst_stage]
            self._slot_done(m.slot, src_dc, dst_dc, seconds)

    async def on_grant(self, d: Delivery) -> None:
        m = d.message
        assert isinstance(m, SlotGrant)
        fut = self._grants.get(m.transfer_id)
        if fut is not None and not fut.done():
            fut.set_result(None)  # a grant for a transfer not (or no longer) waiting is a repeat

    # --- receiving -------------------------------------------------------------------------

    async def on_ready(self, d: Delivery) -> None:
        m = d.message
        assert isinstance(m, TensorReady)
        if m.run != self.run:
            raise Reject(f"the inbox of run {self.run} got a TensorReady of run {m.run}")
        try:
            key = TensorKey.of(m)
        except ValueError:
            raise Reject(f"a TensorReady names no direction along the pipeline: {m.what!r}") from None
        gen = self.generation()
        if m.generation != gen:
            if not m.release and m.generation == self.plane.previous_generation:
                await self._drain(m)
            self._landed_slot(m)
            return
        await self.formed.wait()
        if m.generation != self.generation():
            self._landed_slot(m)
            return  # the run moved on meanwhile
        if m.release:
            self._released.add(key)
            if key in self._landed:
                self.mailbox.put(key, self._landed.pop(key))  # it arrives now: the release was read
            return
        if key in self._posted:
            return  # a redelivery: the receive is already posted
        self._posted.add(key)
        posted = time.monotonic()
        try:
            tensor = await self._receive(m, key, gen)
        except PlaneError as exc:
            self._fail(gen, exc)
            return
        finally:
            self._landed_slot(m, time.monotonic() - posted)
        if gen != self.generation():
            return  # the run moved on while it landed
        if m.hold and key not in self._released:
            self._landed[key] = tensor
        else:
            self.mailbox.put(key, tensor)

    def _receive(self, m: TensorReady, key: TensorKey | None = None, gen: int = -1) -> asyncio.Future[torch.Tensor]:
        """Post the receive of the tensor `m` announces, on the groups of its generation. With a
        `key`, a tensor not held for a WAN release arrives (`Mailbox.landed`) the moment the
        receive returns, in its thread: the prefill thread sees it then, and the bubble's overrun
        counts from then, whenever the event loop gets to `put` it (while generation `gen` lasts)."""
        peer, tag = slot_name(m.replica, m.src_stage), tag_of(m.what, m.iteration, m.microbatch)
        dtype, shape = torch_dtype(m.dtype), tuple(m.shape)

        def receive() -> torch.Tensor:
            tensor = self.plane.recv(m.generation, peer, dtype, shape, tag)
            if key is not None and gen == self.generation() and (not m.hold or key in self._released):
                self.mailbox.landed(key, time.time())
            return tensor

        return in_thread(receive)

    async def _drain(self, m: TensorReady) -> None:
        """Take a tensor a peer sent before the run resumed, and drop it: its sender's thread is
        then free instead of waiting for a receive that would never be posted."""
        with contextlib.suppress(PlaneError):  # that generation's peer is gone: nothing waits for it
            self.plane.release(await self._receive(m))

    # --- failures --------------------------------------------------------------------------

    def _fail(self, gen: int, exc: PlaneError) -> None:
        if gen != self.generation():
            log.debug("a transfer of an earlier generation failed", error=str(exc))
            return
        if not self.failed.is_set():
            self.error = str(exc)
            # Not a warning yet: a peer that stopped on purpose (the end of a run, Ctrl-C) closes its
            # connections too. The membership loop learns which it was from the slots' leases and
            # says so: a quiet stop, or "the run pauses to recover" (a warning) for a lost peer.
            log.info(
                "a data plane transfer failed; learning why from the slots (a stop, or a lost peer)",
                slot=self.slot.name,
                error=str(exc),
            )
            self.failed.set()

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self, timeout_s: float) -> bool:
        """Wait for the sends under way, those still waiting for their WAN slot included (the
        grant comes on the inbox: a worker that finished must keep reading it until then).
        Returns whether they all finished in time."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        return not self._tasks

    async def close(self) -> None:
        """Let the sends under way finish (their receivers are taking them), then drop the groups.
        A data-plane thread still inside gloo when the interpreter exits aborts the process."""
        await self.flush(CLOSE_GRACE_S)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.plane.close()
