"""The data plane: tensors between workers over torch.distributed (gloo), never through Redis.

Each worker holds, per recovery generation:

* one **pair** with each pipeline neighbour: `connections` two-rank gloo groups, each its own TCP
  connection. A tensor is cut into that many contiguous chunks that travel concurrently, one per
  connection (Atlas: several TCP connections per cross-DC transfer, so a window-capped WAN link is
  filled). Same-DC pairs use one connection;
* one **DP group** with the other replicas of its stage (inside one DC): the gradient all-reduce.

Rank 0 of a pair is the earlier stage. gloo's rank 0 listens and rank 1 connects, so each of a
pair's connections has a distinct listening address (the earlier stage's address for that
connection index): that is what the kernel WAN mode classifies each connection by.

Control stays on Redis: a sender announces each tensor (`TensorReady`, which names its dtype, shape
and tag) and the receiver posts its receive only then, so a receive never waits for a tensor that
is not coming. gloo has no way to cancel a posted operation; this design never needs one. A peer
that dies mid-transfer closes its sockets and the operation on this side fails at once
(`PlaneError`); a peer that hangs is bounded by the groups' timeout.

Blocking calls (`send`, `recv`, `all_reduce_mean`, `form`) run in threads; `in_thread` wraps one
as an awaitable on a daemon thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shared.dataplane.pool import BufferPool
from shared.dataplane.store import RedisStore
from shared.runtime.logs import get_logger
from shared.wire import keys

log = get_logger(__name__)

T = TypeVar("T")

#: Largest microbatch index a tag can carry.
MAX_MICROBATCHES = 4096


class PlaneError(RuntimeError):
    """A transfer or collective failed (a peer died, or did not answer within the timeout)."""


@dataclass(frozen=True)
class PairSpec:
    """This worker's end of the pair with one pipeline neighbour."""

    peer: str  # the neighbour's slot name, e.g. "r0s1"
    key: str  # the pair's name, the same at both ends, e.g. "r0:s0-s1"
    rank: int  # 0 = the earlier stage (listens), 1 = the later
    connections: int


@dataclass(frozen=True)
class GroupSpec:
    """This worker's place in its stage's DP group."""

    key: str  # e.g. "dp:s0"
    rank: int  # the replica
    size: int


def tag_of(what: str, iteration: int, microbatch: int) -> int:
    """The gloo tag of one tensor: unique per (what, iteration, microbatch) within a generation
    (iterations wrap after 2**18; tensors that far apart are never in flight together)."""
    if not 0 <= microbatch < MAX_MICROBATCHES:
        raise ValueError(f"microbatch {microbatch} outside 0..{MAX_MICROBATCHES - 1}")
    return ((iteration % (1 << 18)) * MAX_MICROBATCHES + microbatch) * 2 + (what == "grad")


def chunks_of(flat: torch.Tensor, connections: int) -> list[torch.Tensor]:
    """The contiguous pieces one tensor travels in, one per connection; both ends cut the same
    flat tensor the same way (fewer pieces than connections when it has fewer elements)."""
    return [c for c in flat.chunk(max(1, connections)) if c.numel()] or [flat]


class _Threads:
    """Daemon threads that run blocking data-plane calls, kept for reuse, grown on demand.

    Why not a thread per call: `Thread.start()` waits until the new thread holds the GIL once, and
    on a worker whose prefill thread is busy that handoff stalled the event loop for milliseconds
    at every transfer. Why not a `ThreadPoolExecutor`: its threads are joined at interpreter exit,
    and a send whose receiver died can block until the groups' timeout. Here a call is a queue put;
    a new thread starts only when every existing one is busy (a few per worker in steady state)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._count = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            grow = self._idle == 0
            if grow:
                self._count += 1
            else:
                self._idle -= 1
        self._jobs.put(job)
        if grow:
            threading.Thread(target=self._run, name=f"plane-{self._count}", daemon=True).start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            with contextlib.suppress(RuntimeError):  # the awaiting loop closed: the worker is stopping
                job()
            with self._lock:
                self._idle += 1


_THREADS = _Threads()


def in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run a blocking call on a data-plane thread; its result (or error) as a future of the
    running loop. Calls never queue behind each other: a send may wait for its receiver for a
    long time, and must not hold up other transfers."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def body() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    _THREADS.submit(body)
    return fut


#: One gloo device per local address in this process, shared by every group bound there: each
#: device runs an event-loop thread, and a worker with 8 connections to each of two neighbours
#: would otherwise wake 17 of them on a 2-core machine.
_DEVICES: dict[str, Any] = {}
_DEVICES_LOCK = threading.Lock()


def device_for(address: str) -> Any:
    with _DEVICES_LOCK:
        if address not in _DEVICES:
            _DEVICES[address] = dist.ProcessGroupGloo.create_device(hostname=address)
        return _DEVICES[address]


def form_group(
    redis_url: str,
    prefix: str,
    rank: int,
    size: int,
    address: str,
    timeout: timedelta,
    called_off: threading.Event | None = None,
) -> dist.ProcessGroup:
    """A gloo group of `size` ranks, this process being `rank`, bound to `address`, meeting the
    others under `prefix` in Redis (blocking until all are there, at most `timeout`, or until
    `called_off` is set)."""
    store = RedisStore(redis_url, prefix, timeout_s=timeout.total_seconds(), called_off=called_off)
    # The gloo options object that takes devices (one bound address) and a timeout.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [device_for(address)]
    opts._timeout = timeout
    # Worker threads run collectives; a pair only sends and receives (done on the caller's
    # thread), and the DP group runs one all-reduce at a time.
    opts._threads = 1
    try:
        group: dist.ProcessGroup = dist.ProcessGroupGloo(store, rank, size, opts)  # type: ignore[assignment]
        return group
    except RuntimeError as exc:
        raise PlaneError(
            f"data-plane group {prefix.rstrip(':')} (rank {rank} of {size}, bound to {address}) did not form: "
            f"{str(exc).splitlines()[0]}"
        ) from None
    finally:
        store.close()


@dataclass
class _Formed:
    generation: int
    pairs: dict[str, list[dist.ProcessGroup]]  # peer -> one group per connection
    dp: dist.ProcessGroup | None
    groups: dict[str, dist.ProcessGroup]  # other collectives' groups by key (the pipeline's own: tie, stages)


class DataPlane:
    """One worker's groups. `form` (re)builds them for a generation; the previous generation's are
    kept until the next one forms, so a transfer still finishing on them completes or fails
    cleanly instead of having its group destroyed under it."""

    def __init__(self, redis_url: str, run: str, addresses: Sequence[str], timeout_s: float = 60.0) -> None:
        if not addresses:
            raise ValueError("the data plane needs at least one local address to bind")
        self.redis_url, self.run, self.addresses = redis_url, run, list(addresses)
        self.timeout = timedelta(seconds=timeout_s)
        self.pool = BufferPool()
        self._current: _Formed | None = None
        self._previous: _Formed | None = None

    @property
    def generation(self) -> int | None:
        return None if self._current is None else self._current.generation

    def _group(
        self, key: str, rank: int, size: int, address: str, called_off: threading.Event | None
    ) -> dist.ProcessGroup:
        return form_group(self.redis_url, key + ":", rank, size, address, self.timeout, called_off)

    def form(
        self,
        generation: int,
        pairs: Sequence[PairSpec],
        dp: GroupSpec | None,
        groups: Sequence[GroupSpec] = (),
        called_off: threading.Event | None = None,
    ) -> None:
        """Build every group of `generation` (blocking; every peer must form its end): the pairs,
        the DP group and the other `groups` (`all_reduce_sum` runs on them by key). All groups
        form concurrently, so no order between workers can deadlock. Setting `called_off` ends the
        wait for peers at once (a `PlaneError`)."""
        prefix = keys.plane_prefix(self.run, generation)
        jobs: dict[tuple[str, int], Callable[[], dist.ProcessGroup]] = {}
        for addr in self.addresses:  # created here, once, before the threads below share them
            device_for(addr)
        for p in pairs:
            for c in range(p.connections):
                addr = self.addresses[c % len(self.addresses)]
                jobs[(p.peer, c)] = functools.partial(self._group, f"{prefix}{p.key}:{c}", p.rank, 2, addr, called_off)
        if dp is not None and dp.size > 1:
            jobs[("dp", 0)] = functools.partial(
                self._group, prefix + dp.key, dp.rank, dp.size, self.addresses[0], called_off
            )
        for g in groups:
            jobs[(g.key, -1)] = functools.partial(
                self._group, prefix + g.key, g.rank, g.size, self.addresses[0], called_off
            )
        with ThreadPoolExecutor(max(1, len(jobs))) as ex:
            futures = {k: ex.submit(job) for k, job in jobs.items()}
            formed_groups = {k: f.result() for k, f in futures.items()}
        formed = _Formed(
            generation,
            {p.peer: [formed_groups[(p.peer, c)] for c in range(p.connections)] for p in pairs},
            formed_groups.get(("dp", 0)),
            {g.key: formed_groups[(g.key, -1)] for g in groups},
        )
        self._previous, self._current = self._current, formed
        log.info(
            "data plane formed",
            generation=generation,
            pairs=",".join(f"{p.peer}x{p.connections}" for p in pairs) or "-",
            dp=dp.size if dp is not None else 1,
        )

    @property
    def previous_generation(self) -> int | None:
        """The generation before the current one, whose groups are still kept (or None)."""
        return None if self._previous is None else self._previous.generation

    def _groups(self, generation: int, peer: str) -> list[dist.ProcessGroup]:
        for formed in (self._current, self._previous):
            if formed is not None and formed.generation == generation:
                return formed.pairs[peer]
        raise PlaneError(f"no data-plane groups of generation {generation} (current {self.generation})")

    def connections(self, peer: str) -> int:
        assert self._current is not None
        return len(self._current.pairs[peer])

    def send(self, generation: int, peer: str, tensor: torch.Tensor, tag: int) -> None:
        """Send `tensor` to `peer` in chunks over the pair's connections, concurrently; returns once
        every chunk has left (blocking)."""
        groups = self._groups(generation, peer)
        flat = tensor.detach().contiguous().reshape(-1)
        rank = 1 - _rank_in(groups[0])
        try:
            works = [g.send([c], rank, tag) for g, c in zip(groups, chunks_of(flat, len(groups)), strict=False)]
        except RuntimeError as exc:  # posting on a connection that is already closed
            raise PlaneError(f"data plane: send to {peer} failed: {str(exc).splitlines()[0]}") from None
        _wait_all(works, f"send to {peer}")

    def recv(self, generation: int, peer: str, dtype: torch.dtype, shape: tuple[int, ...], tag: int) -> torch.Tensor:
        """Receive the tensor `peer` announced into a pooled buffer (blocking); `release` it when
        it is dead."""
        groups = self._groups(generation, peer)
        out = self.pool.take(dtype, shape)
        flat = out.reshape(-1)
        rank = 1 - _rank_in(groups[0])
        try:
            works = [g.recv([c], rank, tag) for g, c in zip(groups, chunks_of(flat, len(groups)), strict=False)]
        except RuntimeError as exc:
            raise PlaneError(f"data plane: receive from {peer} failed: {str(exc).splitlines()[0]}") from None
        _wait_all(works, f"receive from {peer}")
        return out

    def all_reduce_mean(self, flat: torch.Tensor, ready_at: float = 0.0) -> tuple[torch.Tensor, float]:
        """The DP group's mean of `flat` (in place; blocking), and the latest `ready_at` of the
        group (when the last replica reached the collective: a device profile counts the
        collective's time from there). With one replica, `flat` itself and `ready_at`."""
        assert self._current is not None, "form the plane first"
        group = self._current.dp
        if group is None:
            return flat, ready_at
        latest = torch.tensor([ready_at], dtype=torch.float64)
        try:
            works = [group.allreduce([flat]), group.allreduce([latest], _max_options())]
        except RuntimeError as exc:
            raise PlaneError(f"data plane: gradient all-reduce failed: {str(exc).splitlines()[0]}") from None
        _wait_all(works, "gradient all-reduce")
        flat /= group.size()
        return flat, float(latest.item())

    def all_reduce_sum(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """The sum of `flat` over the current generation's group `key` (in place; blocking)."""
        assert self._current is not None, "form the plane first"
        group = self._current.groups[key]
        try:
            works = [group.allreduce([flat])]
        except RuntimeError as exc:
            raise PlaneError(f"data plane: all-reduce of {key} failed: {str(exc).splitlines()[0]}") from None
        _wait_all(works, f"all-reduce of {key}")
        return flat

    def broadcast_dp(self, data: bytes | None, root: int) -> bytes:
        """`data` from rank `root` of the DP group (its replica) to every member (blocking; the
        root passes it, the others None): a stage's state handed to a replacement by a live peer.
        The length goes first, then the bytes, both over the group's connection."""
        assert self._current is not None, "form the plane first"
        group = self._current.dp
        if group is None:
            raise PlaneError("data plane: no DP group to hand a stage's state over (one replica)")
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        _wait_all([_post(lambda: group.broadcast([size], opts), "state broadcast")], "state broadcast (size)")
        n = int(size.item())
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data is not None
            else torch.empty(n, dtype=torch.uint8)
        )
        _wait_all([_post(lambda: group.broadcast([buf], opts), "state broadcast")], "state broadcast")
        return data if data is not None else buf.numpy().tobytes()

    def release(self, tensor: torch.Tensor) -> None:
        self.pool.release(tensor)

    def close(self) -> None:
        """Drop every group: their sockets close, so a peer still waiting on one fails at once."""
        self._current = self._previous = None


def _max_options() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # the stub types the enum value apart
    return opts


def _post(op: Callable[[], Any], what: str) -> Any:
    """A collective posted on the group (a closed connection refuses it at once)."""
    try:
        return op()
    except RuntimeError as exc:
        raise PlaneError(f"data plane: {what} failed: {str(exc).splitlines()[0]}") from None


def _rank_in(group: dist.ProcessGroup) -> int:
    return group.rank()


def _wait_all(works: list[Any], what: str) -> None:
    try:
        for w in works:
            w.wait()
    except RuntimeError as exc:
        raise PlaneError(f"data plane: {what} failed: {str(exc).splitlines()[0]}") from None
