"""The receiving end of bench/transport_throughput.py: a process that receives each transfer the
sender announces (a Redis stream, a data-plane pair, a raw socket), acks it on a Pipe, and checks
the contents of the warm-ups (before its ack) and of each size's last transfer (after it).
Not a benchmark (`make bench` runs only bench/*.py)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from bench.lib.transfers import WARMUP
from shared.bus.connection import sync_client_for
from shared.dataplane import DataPlane, PairSpec
from shared.dataplane.tensors import from_blob
from shared.runtime.lifetime import die_with_parent
from shared.wire import FIELD, TensorBlob

ACK = b"\x01"
#: How long the receiver waits for one transfer before it gives up (a stuck sender is a bug).
RECV_TIMEOUT_S = 120.0

# A plan: (shape, transfers of that shape, warm-ups included), in order.
Plan = list[tuple[tuple[int, ...], int]]


def make_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """Known contents (the receiver checks them)."""
    return (torch.arange(math.prod(shape), dtype=torch.int64) % 65_521).to(torch.float32).reshape(shape)


def wrong(t: torch.Tensor, shape: tuple[int, ...]) -> str | None:
    """What is wrong with a received tensor, or None when it is `make_tensor(shape)` (257 samples)."""
    if tuple(t.shape) != shape or t.dtype != torch.float32:
        return f"received {t.dtype} {tuple(t.shape)}, expected float32 {shape}"
    flat = t.reshape(-1)
    idx = torch.linspace(0, flat.numel() - 1, 257).to(torch.int64)
    return None if torch.equal(flat[idx], (idx % 65_521).to(torch.float32)) else f"wrong contents at {shape}"


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy; keep `t` alive)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))


def receiver_main(conn: Connection) -> None:
    """The receiving process: runs one command at a time from the sender, acking each transfer."""
    die_with_parent()
    handlers: dict[str, Callable[..., None]] = {"redis": recv_redis, "plane": recv_plane, "socket": recv_socket}
    with contextlib.suppress(EOFError, KeyboardInterrupt, BrokenPipeError):
        while (cmd := conn.recv()) is not None:
            kind, args = cmd
            try:
                handlers[kind](conn, **args)
            except Exception as exc:
                conn.send(("error", f"{kind} receiver: {type(exc).__name__}: {exc}"))
                raise


def receive(conn: Connection, plan: Plan, get: Callable[[tuple[int, ...]], torch.Tensor], done: Any = None) -> None:
    """`get` every transfer of `plan` and ack it; check the warm-ups before the ack and each size's
    last transfer after it; `done(t)` once a tensor is used; then report ("checked", n, problems)."""
    checked, problems = 0, []
    for shape, count in plan:
        for i in range(count):
            t = get(shape)
            last = i == count - 1 and i >= WARMUP
            if i < WARMUP and (why := wrong(t, shape)):
                problems.append(f"transfer {i + 1} of {count}: {why}")
            conn.send_bytes(ACK)
            if last and (why := wrong(t, shape)):
                problems.append(f"transfer {i + 1} of {count}: {why}")
            checked += i < WARMUP or last
            if done is not None:
                done(t)
    conn.send(("checked", checked, problems))


def recv_redis(conn: Connection, url: str, stream: str, plan: Plan) -> None:
    r = sync_client_for(url, socket_timeout=RECV_TIMEOUT_S + 10)
    decoder = msgspec.msgpack.Decoder(TensorBlob)
    cursor: list[bytes | str] = ["0-0"]

    def get(_shape: tuple[int, ...]) -> torch.Tensor:
        reply: Any = r.xread({stream: cursor[0]}, count=1, block=int(RECV_TIMEOUT_S * 1000))
        if not reply:
            raise TimeoutError(f"nothing on {stream} within {RECV_TIMEOUT_S:.0f}s")
        cursor[0], fields = reply[0][1][0]
        return from_blob(decoder.decode(fields[FIELD]))

    conn.send("ready")
    try:
        receive(conn, plan, get)
    finally:
        r.close()


def recv_plane(conn: Connection, url: str, run: str, key: str, connections: int, plan: Plan) -> None:
    plane = DataPlane(url, run, ["127.0.0.1"], timeout_s=RECV_TIMEOUT_S)
    tags = itertools.count()
    try:
        plane.form(0, [PairSpec("sender", key, 1, connections)], None)
        conn.send("ready")
        # released once used: its buffer goes back to the pool, as in training
        receive(conn, plan, lambda shape: plane.recv(0, "sender", torch.float32, shape, next(tags)), plane.release)
    finally:
        plane.close()


def recv_socket(conn: Connection, plan: Plan) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(RECV_TIMEOUT_S)
        conn.send(("port", srv.getsockname()[1]))
        s, _ = srv.accept()
    buffers: dict[tuple[int, ...], tuple[torch.Tensor, memoryview]] = {}

    def get(shape: tuple[int, ...]) -> torch.Tensor:
        if shape not in buffers:  # one reused buffer per shape, as a torch tensor
            buf = torch.empty(shape, dtype=torch.float32)
            buffers[shape] = (buf, byte_view(buf))
        buf, view = buffers[shape]
        n, got = view.nbytes, 0
        while got < n:
            k = s.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("sender closed the socket mid-tensor")
            got += k
        return buf

    with s:
        s.settimeout(RECV_TIMEOUT_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send("ready")
        receive(conn, plan, get)
