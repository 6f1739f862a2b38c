"""Tensor throughput: one tensor from one process to another, three ways.

The same float32 tensors (1, 16 and 64 MiB; 1 MiB = 2**20 bytes) go from this process (the sender)
to a receiver process on this machine, three ways, in one run:

* ``redis``: the old path. The sender builds ``msgspec.msgpack.encode(to_blob(t))`` (the
  `shared.wire.TensorBlob` encoding tensors had on streams) and XADDs it; the receiver, blocked
  in XREAD, decodes it and `from_blob`s it into a tensor of its own. The sender XDELs each entry
  after the transfer (outside the timed window) and trims the stream at the end;
* ``plane``: `shared.dataplane.DataPlane.send` / `.recv` over a pair formed with one connection
  (the same-DC path); the receiver gets a pooled buffer and releases it after use, as training
  does. Also measured at 64 MiB with ``--connections N`` connections (the cross-DC path);
* ``socket``: one raw TCP socket, ``sendall`` of the tensor's memory and ``recv_into`` a reused
  buffer that a torch tensor views: the ceiling for one connection.

Every transfer is timed by ``time.perf_counter`` in the sender alone: from the moment the sender
starts with the tensor in hand (for ``redis`` before ``to_blob`` + encode, which the old path paid
on every send; the encode share is reported apart as ``redis_encode_ms_64mb``) until it reads the
receiver's 1-byte ack on a multiprocessing Pipe, written once the receiver holds the whole tensor
as a usable torch tensor. Nothing is subtracted. Per size and way: 2 warm-up transfers, then the
median of N timed ones. GB/s = bytes / median seconds, 1 GB = 1e9 bytes.

``valid``: the receiver (bench/lib/tensor_receiver.py) checked the contents of the 2 warm-ups (before
its ack) and of the last timed transfer (after it) of every size and way; ``why`` says what arrived
wrong, if anything.
The claims are ``ratio_vs_redis_64mb`` >= 10 and ``ratio_vs_socket_64mb`` >= 0.5 (``targets_met``).

    python bench/transport_throughput.py            # 20 timed transfers per size
    python bench/transport_throughput.py --quick    # 5 (3 at 64 MiB)

Human-readable lines on stderr, then one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import multiprocessing as mp
import pickle
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import msgspec
import torch

from bench.lib.children import spawn_child, stop_child, stop_on_sigterm
from bench.lib.output import emit, stderr, verdict
from bench.lib.tensor_receiver import ACK, RECV_TIMEOUT_S, Plan, byte_view, make_tensor, receiver_main
from bench.lib.transfers import MIB, WARMUP
from shared.bus.connection import sync_client_for
from shared.dataplane import DataPlane, PairSpec
from shared.dataplane.tensors import to_blob
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import FIELD

SIZES_MB = (1, 16, 64)
#: Numbers the data-plane pairs this run forms (each needs rendezvous keys of its own).
FORMATIONS = itertools.count()

Times = dict[tuple[int, ...], list[float]]


def shape_of(mb: int) -> tuple[int, ...]:
    """A float32 tensor of `mb` MiB, two-dimensional like an activation."""
    return (mb * MIB // (4 * 1024), 1024)


class Receiver:
    """The receiver process and its Pipe (commands out, acks and notes back)."""

    def __init__(self) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = spawn_child(receiver_main, (child,), "transport-receiver")
        child.close()
        self.problems: list[str] = []
        self.checked = 0

    def command(self, kind: str, **args: Any) -> None:
        self.conn.send((kind, args))

    def note(self, timeout: float = 120.0) -> Any:
        """The receiver's next message (an error it reports is raised here)."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the receiver said nothing for {timeout:.0f}s")
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg[0] == "error":
            raise RuntimeError(msg[1])
        return msg

    def ack(self) -> None:
        if not self.conn.poll(RECV_TIMEOUT_S):
            raise TimeoutError("no ack from the receiver")
        got = self.conn.recv_bytes()
        if got != ACK:  # a pickled ("error", why) from a failing receiver (our own child)
            raise RuntimeError(pickle.loads(got)[1])

    def checks(self, way: str) -> None:
        """Collect the receiver's checks of the plan just sent `way`."""
        _, checked, problems = self.note()
        self.checked += checked
        self.problems += [f"{way}: {p}" for p in problems]

    def close(self, graceful: bool = True) -> None:
        """Stop the receiver: asked to (`graceful`), else at once (it may be blocked mid-transfer)."""
        if graceful:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        stop_child(self.proc, 10 if graceful else 0)
        self.conn.close()


def timed(send: Callable[[torch.Tensor], Any], rx: Receiver, plan: Plan, after: Any = None) -> Times:
    """Seconds per timed transfer, by shape: `send` starts -> the receiver's ack is read; then
    `after()`, outside the timed window, after every transfer."""
    out: Times = {}
    for shape, count in plan:
        t = make_tensor(shape)
        times = out.setdefault(shape, [])
        for i in range(count):
            t0 = time.perf_counter()
            send(t)
            rx.ack()
            elapsed = time.perf_counter() - t0
            if after is not None:
                after()
            if i >= WARMUP:
                times.append(elapsed)
    return out


def via_redis(rx: Receiver, url: str, plan: Plan) -> tuple[Times, float]:
    r = sync_client_for(url)
    stream = "bench:transport"
    encode_s: list[float] = []
    sent: list[Any] = []

    def send(t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        payload = msgspec.msgpack.encode(to_blob(t))
        if tuple(t.shape) == plan[-1][0]:
            encode_s.append(time.perf_counter() - t0)
        sent.append(r.xadd(stream, {FIELD: payload}))

    try:
        rx.command("redis", url=url, stream=stream, plan=plan)
        rx.note()
        # Redis does not keep the tensor: each entry is deleted once acked (outside the timed window)
        times = timed(send, rx, plan, lambda: r.xdel(stream, sent.pop()))
        rx.checks("redis")
        r.xtrim(stream, maxlen=0, approximate=False)
        r.delete(stream)
    finally:
        r.close()
    return times, statistics.median(encode_s[WARMUP:] or [0.0])  # the last size's timed transfers


def via_plane(rx: Receiver, url: str, connections: int, plan: Plan) -> Times:
    run = f"transport-{next(FORMATIONS)}-{connections}c"  # fresh rendezvous keys for every pair formed
    rx.command("plane", url=url, run=run, key="bench", connections=connections, plan=plan)
    plane = DataPlane(url, run, ["127.0.0.1"], timeout_s=RECV_TIMEOUT_S)
    try:
        plane.form(0, [PairSpec("receiver", "bench", 0, connections)], None)
        rx.note()
        tags = itertools.count()
        times = timed(lambda t: plane.send(0, "receiver", t, next(tags)), rx, plan)
        rx.checks(f"plane ({connections} conn)")
        return times
    finally:
        plane.close()


def via_socket(rx: Receiver, plan: Plan) -> Times:
    rx.command("socket", plan=plan)
    _, port = rx.note()
    with socket.create_connection(("127.0.0.1", port), timeout=RECV_TIMEOUT_S) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rx.note()
        times = timed(lambda t: s.sendall(byte_view(t)), rx, plan)
    rx.checks("socket")
    return times


def gbps(shape: tuple[int, ...], seconds: list[float]) -> float:
    return math.prod(shape) * 4 / statistics.median(seconds) / 1e9


def run(repeat: int, repeat_64: int, connections: int) -> dict[str, Any]:
    """Every figure, ``targets_met``, ``valid`` and ``why``."""
    plan: Plan = [(shape_of(mb), WARMUP + (repeat_64 if mb == 64 else repeat)) for mb in SIZES_MB]
    big = shape_of(64)
    server = EmbeddedRedis().start()
    rx = Receiver()
    graceful = False
    try:
        stderr(f"transfers per size: {WARMUP} warm-up + {repeat} timed ({repeat_64} at 64 MiB)")
        redis_t, encode_s = via_redis(rx, server.url, plan)
        plane_t = via_plane(rx, server.url, 1, plan)
        multi_t = via_plane(rx, server.url, connections, [(big, WARMUP + repeat_64)])
        socket_t = via_socket(rx, plan)
        graceful = True
    finally:
        rx.close(graceful)
        server.stop()
    result: dict[str, Any] = {}
    stderr(f"{'size':>8} {'redis stream':>22} {'data plane (1 conn)':>22} {'raw socket':>22}")
    for mb in SIZES_MB:
        shape, cells = shape_of(mb), []
        for way, times in (("redis", redis_t), ("plane", plane_t), ("socket", socket_t)):
            result[f"{way}_GBps_{mb}mb"] = round(gbps(shape, times[shape]), 4)
            cells.append(f"{gbps(shape, times[shape]):7.3f} GB/s {statistics.median(times[shape]) * 1000:8.2f} ms")
        stderr(f"{mb:>5}MiB " + " ".join(f"{c:>22}" for c in cells))
    multi = gbps(big, multi_t[big])
    result[f"plane_GBps_64mb_{connections}conn"] = round(multi, 4)
    result["redis_encode_ms_64mb"] = round(encode_s * 1000, 3)
    result["ratio_vs_redis_64mb"] = round(result["plane_GBps_64mb"] / result["redis_GBps_64mb"], 3)
    result["ratio_vs_socket_64mb"] = round(result["plane_GBps_64mb"] / result["socket_GBps_64mb"], 3)
    result["targets_met"] = result["ratio_vs_redis_64mb"] >= 10 and result["ratio_vs_socket_64mb"] >= 0.5
    stderr(
        f"data plane, 64 MiB over {connections} connections: {multi:.3f} GB/s; redis: to_blob+encode alone "
        f"{encode_s * 1000:.1f} ms of {statistics.median(redis_t[big]) * 1000:.1f} ms\n"
        f"plane / redis at 64 MiB: {result['ratio_vs_redis_64mb']:.1f}x (target >= 10); "
        f"plane / socket: {result['ratio_vs_socket_64mb']:.2f} (target >= 0.5)"
    )
    result.update(verdict(rx.problems, f"all {rx.checked} checked transfers arrived exactly"))
    return result


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="5 timed transfers per size (3 at 64 MiB)")
    ap.add_argument("--repeat", type=int, metavar="N", help="timed transfers per size (default 20; --quick 5)")
    ap.add_argument("--connections", type=int, default=4, metavar="N", help="connections of the extra 64 MiB plane run")


def repeats(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int]:
    """(timed transfers per size, at 64 MiB), checked."""
    repeat = args.repeat if args.repeat is not None else (5 if args.quick else 20)
    if repeat < 1 or args.connections < 1:
        ap.error("--repeat and --connections must be at least 1")
    return repeat, min(repeat, 3) if args.quick else repeat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    args = ap.parse_args(argv)
    repeat, repeat_64 = repeats(ap, args)
    stop_on_sigterm()
    started = time.perf_counter()
    try:
        result = {"bench": "transport_throughput", **run(repeat, repeat_64, args.connections)}
    except KeyboardInterrupt:
        stderr("interrupted: receiver and redis-server stopped")
        return 130
    result.update(repeat=repeat, repeat_64mb=repeat_64, warmup=WARMUP, connections=args.connections, quick=args.quick)
    emit({**result, "seconds": round(time.perf_counter() - started, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
