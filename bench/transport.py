"""Transport benchmark: one tensor from one process to another, three ways, then "Redis carries no
tensor" checked on live training runs.

Part 1 (throughput). The same float32 tensors (1, 16 and 64 MiB; 1 MiB = 2**20 bytes) go from this
process (the sender) to a receiver process on this machine, three ways, in one run:

* ``redis``: the old path. The sender builds ``msgspec.msgpack.encode(to_blob(t))`` (the
  `shared.wire.TensorBlob` encoding tensors had on streams) and XADDs it; the receiver, blocked
  in XREAD, decodes it and `from_blob`s it into a tensor of its own. The sender XDELs each entry
  after the transfer (outside the timed window) and trims the stream at the end, so Redis does
  not grow;
* ``plane``: `shared.dataplane.DataPlane.send` / `.recv` over a pair formed with one connection
  (the same-DC path); the receiver gets a pooled buffer and releases it after use, as training
  does. Also measured at 64 MiB with ``--connections N`` connections (the tensor chunked over N
  concurrent connections, the cross-DC path);
* ``socket``: one raw TCP socket, ``sendall`` of the tensor's memory and ``recv_into`` a reused
  buffer that a torch tensor views: the ceiling for one connection.

Every transfer is timed the same way, by ``time.perf_counter`` in the sender alone: from the moment
the sender starts with the tensor in hand (for ``redis`` that is before ``to_blob`` + encode, which
the old path paid on every send; the encode share is reported apart as ``redis_encode_ms_64mb``)
until the sender reads the receiver's 1-byte ack on a multiprocessing Pipe, which the receiver
writes once it holds the whole tensor as a usable torch tensor. Nothing is subtracted: the ack's
own trip (tens of microseconds) is inside every figure. Per size and way: 2 warm-up transfers
(their contents are checked at the receiver), then the median of N timed ones.
GB/s = bytes / median seconds, 1 GB = 1e9 bytes.

Part 2 (``--training``, on by default): the repo's own launcher (`run_training`: a wan_broker and
PP x DP stage-worker processes) trains the demo spec (configs/demo.yaml, 4 iterations, bubbletea
off) twice, each against its own fresh private redis-server: once with the shipped tiny model
(8 KiB activations) and once with d_model 512 x seq_len 512 (2 MiB activations; 2 layers, one block
per stage, keep it under a minute on 2 cores; the WAN link made fast enough that a 2 MiB activation
does not take seconds on the demo's 3.3 Mb/s). A sampler polls ``INFO memory`` and reads every
stream entry as it appears (a ``SCAN ... TYPE stream`` then XRANGE from each stream's last seen
id, several times a second and once at the end, so entries that the bus trims once acked are seen
too). ``max_entry_bytes`` is the largest entry (sum of field and value lengths) over both runs;
``redis_peak_mb_*`` is Redis's own ``used_memory_peak`` in MiB. If tensors rode Redis, the large
run's entries would be >= 2 MiB and its peak several MiB higher. With 4 iterations no checkpoint
is due (the demo's `training.checkpoint_every` is 10); with ``--iterations 10`` or more the
workers' checkpoints (weights and AdamW state, Redis hashes) would count in the peak. A training
run that fails fails the benchmark (``training_failures`` is 0 in every JSON line it prints).

    python bench/transport.py                 # full run (2-4 minutes on 2 cores)
    python bench/transport.py --quick         # fewer transfers
    python bench/transport.py --no-training   # part 1 only

Part 3 (KV caches): a finished prefill's 0.5 MiB KV cache (the demo model, a 256-token prompt)
fetched by a decoder from its holder, a separate process, over the data plane
(`shared.dataplane.kv.fetch`: a group formed per fetch), against a Redis GET of the same bytes:
``kv_fetch_ms_p50``, ``kv_fetch_ms_p99``, ``kv_redis_get_ms_p50``.

Prints human-readable lines on stderr, then one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import ctypes
import io
import itertools
import json
import math
import multiprocessing as mp
import pickle
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import redis
import redis.asyncio
import torch
import yaml

from shared.bus import Bus
from shared.dataplane import DataPlane, PairSpec
from shared.dataplane import kv as kv_plane
from shared.dataplane.kv import KvServer, KvShelf
from shared.lifetime import die_with_parent
from shared.redis_server import EmbeddedRedis
from shared.tensors import from_blob, to_blob
from shared.wire import FIELD, TensorBlob

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
SIZES_MB = (1, 16, 64)
WARMUP = 2
ACK = b"\x01"
#: How long the receiver waits for one transfer before it gives up (a stuck sender is a bug).
RECV_TIMEOUT_S = 120.0
#: `no_tensor_in_redis` bounds: no stream entry over 64 KiB, and the 2 MiB-activation run's Redis
#: peak at most this many MiB above the tiny model's.
MAX_ENTRY_BYTES = 65536
MAX_PEAK_DELTA_MB = 8.0
#: Tries per training run (a run that fails is started again on a fresh redis-server).
TRAIN_ATTEMPTS = 1  # a failed training run fails the bench: its figures would not be comparable

#: Numbers the data-plane pairs this run forms (each needs rendezvous keys of its own).
FORMATIONS = itertools.count()

# A plan: (shape, transfers of that shape, warm-ups included), in order.
Plan = list[tuple[tuple[int, ...], int]]


def shape_of(mb: int) -> tuple[int, ...]:
    """A float32 tensor of `mb` MiB, two-dimensional like an activation."""
    return (mb * MIB // (4 * 1024), 1024)


def make_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """Known contents (the receiver checks them on warm-up transfers)."""
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.int64) % 65_521).to(torch.float32).reshape(shape)


def check_tensor(t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape or t.dtype != torch.float32:
        raise AssertionError(f"received {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
    flat = t.reshape(-1)
    idx = torch.linspace(0, flat.numel() - 1, 257).to(torch.int64)
    if not torch.equal(flat[idx], (idx % 65_521).to(torch.float32)):
        raise AssertionError(f"received tensor of shape {shape} has the wrong contents")


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy; keep `t` alive)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))


# --- the receiver process ---------------------------------------------------------------------


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


def transfers(plan: Plan) -> Iterator[tuple[tuple[int, ...], bool]]:
    """Each transfer's shape, and whether it is a warm-up (checked, not timed)."""
    for shape, count in plan:
        for i in range(count):
            yield shape, i < WARMUP


def recv_redis(conn: Connection, url: str, stream: str, plan: Plan) -> None:
    r = redis.Redis.from_url(url, protocol=2, socket_timeout=RECV_TIMEOUT_S + 10)
    decoder = msgspec.msgpack.Decoder(TensorBlob)
    cursor: bytes | str = "0-0"
    conn.send("ready")
    try:
        for shape, warm in transfers(plan):
            reply: Any = r.xread({stream: cursor}, count=1, block=int(RECV_TIMEOUT_S * 1000))
            if not reply:
                raise TimeoutError(f"nothing on {stream} within {RECV_TIMEOUT_S:.0f}s")
            cursor, fields = reply[0][1][0]
            t = from_blob(decoder.decode(fields[FIELD]))
            if warm:
                check_tensor(t, shape)
            conn.send_bytes(ACK)
            del t, fields, reply
    finally:
        r.close()


def recv_plane(conn: Connection, url: str, run: str, key: str, connections: int, plan: Plan) -> None:
    plane = DataPlane(url, run, ["127.0.0.1"], timeout_s=RECV_TIMEOUT_S)
    try:
        plane.form(0, [PairSpec("sender", key, 1, connections)], None)
        conn.send("ready")
        for tag, (shape, warm) in enumerate(transfers(plan)):
            t = plane.recv(0, "sender", torch.float32, shape, tag)
            if warm:
                check_tensor(t, shape)
            conn.send_bytes(ACK)
            plane.release(t)  # the tensor is dead once used: its buffer goes back to the pool
    finally:
        plane.close()


def recv_socket(conn: Connection, plan: Plan) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(RECV_TIMEOUT_S)
        conn.send(("port", srv.getsockname()[1]))
        s, _ = srv.accept()
    with s:
        s.settimeout(RECV_TIMEOUT_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send("ready")
        buffers: dict[tuple[int, ...], tuple[torch.Tensor, memoryview]] = {}
        for shape, warm in transfers(plan):
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
            if warm:
                check_tensor(buf, shape)
            conn.send_bytes(ACK)


# --- the sender (this process) ----------------------------------------------------------------


class Receiver:
    """The receiver process and its Pipe (commands out, acks and notes back)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")  # torch + fork is unsafe
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child,), name="transport-receiver", daemon=True)
        # Started with SIGINT ignored: a Ctrl-C is this process's to handle (it stops the
        # receiver), not a traceback from the receiver's imports.
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.proc.start()
        finally:
            signal.signal(signal.SIGINT, sigint)
        child.close()

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

    def close(self, graceful: bool = True) -> None:
        """Stop the receiver: asked to (`graceful`), else at once (it may be blocked mid-transfer)."""
        if graceful:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def timed(send: Callable[[torch.Tensor], None], rx: Receiver, plan: Plan) -> dict[tuple[int, ...], list[float]]:
    """Seconds per timed transfer, by shape: `send` starts -> the receiver's ack is read."""
    out: dict[tuple[int, ...], list[float]] = {}
    for shape, count in plan:
        t = make_tensor(shape)
        times = out.setdefault(shape, [])
        for i in range(count):
            t0 = time.perf_counter()
            send(t)
            rx.ack()
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
    return out


def via_redis(rx: Receiver, url: str, plan: Plan) -> tuple[dict[tuple[int, ...], list[float]], float]:
    r = redis.Redis.from_url(url, protocol=2)
    stream = "bench:transport"
    encode_s: list[float] = []
    times: dict[tuple[int, ...], list[float]] = {}
    try:
        rx.command("redis", url=url, stream=stream, plan=plan)
        rx.note()
        for shape, count in plan:
            t = make_tensor(shape)
            row = times.setdefault(shape, [])
            for i in range(count):
                t0 = time.perf_counter()
                payload = msgspec.msgpack.encode(to_blob(t))
                t1 = time.perf_counter()
                entry = r.xadd(stream, {FIELD: payload})
                rx.ack()
                t2 = time.perf_counter()
                r.xdel(stream, entry)  # Redis does not keep the tensor (outside the timed window)
                del payload
                if i >= WARMUP:
                    row.append(t2 - t0)
                    if shape == plan[-1][0]:
                        encode_s.append(t1 - t0)
        r.xtrim(stream, maxlen=0, approximate=False)
        r.delete(stream)
    finally:
        r.close()
    return times, statistics.median(encode_s) if encode_s else 0.0


def via_plane(rx: Receiver, url: str, connections: int, plan: Plan) -> dict[tuple[int, ...], list[float]]:
    run = f"transport-{next(FORMATIONS)}-{connections}c"  # fresh rendezvous keys for every pair formed
    rx.command("plane", url=url, run=run, key="bench", connections=connections, plan=plan)
    plane = DataPlane(url, run, ["127.0.0.1"], timeout_s=RECV_TIMEOUT_S)
    try:
        plane.form(0, [PairSpec("receiver", "bench", 0, connections)], None)
        rx.note()
        tags = iter(range(1 << 30))
        return timed(lambda t: plane.send(0, "receiver", t, next(tags)), rx, plan)
    finally:
        plane.close()


def via_socket(rx: Receiver, plan: Plan) -> dict[tuple[int, ...], list[float]]:
    rx.command("socket", plan=plan)
    _, port = rx.note()
    with socket.create_connection(("127.0.0.1", port), timeout=RECV_TIMEOUT_S) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rx.note()
        return timed(lambda t: s.sendall(byte_view(t)), rx, plan)


def gbps(shape: tuple[int, ...], seconds: list[float]) -> float:
    return math.prod(shape) * 4 / statistics.median(seconds) / 1e9


def transport_part(repeat: int, repeat_64: int, connections: int) -> dict[str, Any]:
    plan: Plan = [(shape_of(mb), WARMUP + (repeat_64 if mb == 64 else repeat)) for mb in SIZES_MB]
    big = shape_of(64)
    server = EmbeddedRedis().start()
    rx = Receiver()
    graceful = False
    try:
        print(f"transfers per size: {WARMUP} warm-up + {repeat} timed ({repeat_64} at 64 MiB)", file=sys.stderr)
        redis_t, encode_s = via_redis(rx, server.url, plan)
        plane_t = via_plane(rx, server.url, 1, plan)
        multi_t = via_plane(rx, server.url, connections, [(big, WARMUP + repeat_64)])
        socket_t = via_socket(rx, plan)
        graceful = True
    finally:
        rx.close(graceful)
        server.stop()
    result: dict[str, Any] = {}
    print(f"{'size':>8} {'redis stream':>22} {'data plane (1 conn)':>22} {'raw socket':>22}", file=sys.stderr)
    for mb in SIZES_MB:
        shape = shape_of(mb)
        cells = []
        for way, times in (("redis", redis_t), ("plane", plane_t), ("socket", socket_t)):
            rate = gbps(shape, times[shape])
            result[f"{way}_GBps_{mb}mb"] = round(rate, 4)
            cells.append(f"{rate:7.3f} GB/s {statistics.median(times[shape]) * 1000:8.2f} ms")
        print(f"{mb:>5}MiB " + " ".join(f"{c:>22}" for c in cells), file=sys.stderr)
    multi = gbps(big, multi_t[big])
    result[f"plane_GBps_64mb_{connections}conn"] = round(multi, 4)
    result["redis_encode_ms_64mb"] = round(encode_s * 1000, 3)
    result["ratio_vs_redis_64mb"] = round(result["plane_GBps_64mb"] / result["redis_GBps_64mb"], 3)
    result["ratio_vs_socket_64mb"] = round(result["plane_GBps_64mb"] / result["socket_GBps_64mb"], 3)
    result["targets_met"] = result["ratio_vs_redis_64mb"] >= 10 and result["ratio_vs_socket_64mb"] >= 0.5
    print(
        f"data plane, 64 MiB over {connections} connections: {multi:.3f} GB/s; "
        f"redis: to_blob+encode alone {encode_s * 1000:.1f} ms of {statistics.median(redis_t[big]) * 1000:.1f} ms",
        file=sys.stderr,
    )
    print(
        f"plane / redis at 64 MiB: {result['ratio_vs_redis_64mb']:.1f}x (target >= 10); "
        f"plane / socket: {result['ratio_vs_socket_64mb']:.2f} (target >= 0.5)",
        file=sys.stderr,
    )
    return result


# --- part 2: Redis carries no tensor ----------------------------------------------------------


class RedisSampler:
    """Polls INFO memory and reads every stream entry as it appears (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.r = redis.asyncio.Redis.from_url(url, protocol=2)
        self.cursors: dict[bytes, bytes] = {}
        self.max_entry = (0, "")
        self.max_used = 0
        self.entries = 0

    async def scan_streams(self) -> None:
        async for key in self.r.scan_iter(count=1000, _type="stream"):
            while True:
                start = b"(" + self.cursors[key] if key in self.cursors else b"-"
                batch: Any = await self.r.xrange(key, min=start, count=500)
                for entry_id, fields in batch:
                    size = sum(len(k) + len(v) for k, v in fields.items())
                    self.entries += 1
                    if size > self.max_entry[0]:
                        self.max_entry = (size, key.decode())
                    self.cursors[key] = entry_id
                if len(batch) < 500:
                    break

    async def memory(self) -> dict[str, Any]:
        info: Any = await self.r.info("memory")
        self.max_used = max(self.max_used, int(info["used_memory"]))
        return info

    async def run(self, stop: asyncio.Event) -> None:
        tick = 0
        while not stop.is_set():
            await self.memory()
            if tick % 5 == 0:
                await self.scan_streams()
            tick += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)

    async def close(self) -> None:
        await self.r.aclose()


def demo_spec(large: bool, iterations: int) -> dict[str, Any]:
    spec: dict[str, Any] = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text()))
    spec["training"]["iterations"] = iterations
    spec["bubbletea"]["enabled"] = False
    if large:
        # 2 x 512 x 512 float32 = 2 MiB activations; one block per stage (activations do not depend
        # on depth) keeps the run under a minute on 2 cores with the demo's microbatches and messages
        spec["model"].update(d_model=512, seq_len=512, heads=8, layers=2)
        spec["training"]["microbatch_size"] = 2
        # the demo's link takes 5 s for 2 MiB: give it 10 Gb/s and a window that does not cap it
        spec["wan"]["default"].update(bandwidth_gbps=10.0, tcp_window_mib=64.0)
    return spec


def activation_mib(spec: dict[str, Any]) -> float:
    return spec["training"]["microbatch_size"] * spec["model"]["seq_len"] * spec["model"]["d_model"] * 4 / MIB


async def train_watched(spec: dict[str, Any], tag: str, workdir: Path) -> dict[str, Any]:
    from bubbletea.launcher.train import run_training
    from shared.settings import load_settings

    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    settings = load_settings(path, env={"BUBBLETEA_RUN": f"transport-{tag}-{int(time.time() * 1000)}"})
    async with EmbeddedRedis() as server:
        sampler = RedisSampler(server.url)
        stop = asyncio.Event()
        watcher = asyncio.create_task(sampler.run(stop))
        t0 = time.perf_counter()
        try:
            result = await run_training(settings, server.url, out=io.StringIO(), progress=False)
        finally:
            stop.set()
            await watcher
        elapsed = time.perf_counter() - t0
        await sampler.scan_streams()
        info = await sampler.memory()
        await sampler.close()
    row = {
        "peak_mb": int(info["used_memory_peak"]) / MIB,
        "max_used_mb": sampler.max_used / MIB,
        "max_entry_bytes": sampler.max_entry[0],
        "max_entry_stream": sampler.max_entry[1],
        "entries": sampler.entries,
        "seconds": elapsed,
        "final_loss": result.losses[-1],
        "iteration_s": result.steady_iteration_s(),
    }
    print(
        f"  {tag:<6} activations {activation_mib(spec):6.3f} MiB  {len(result.losses)} iterations in {elapsed:5.1f} s "
        f"(steady {row['iteration_s']:.2f} s each, loss {row['final_loss']:.3f})  "
        f"redis peak {row['peak_mb']:6.2f} MiB  "
        f"largest of {row['entries']} stream entries {row['max_entry_bytes']} B ({row['max_entry_stream']})",
        file=sys.stderr,
        flush=True,
    )
    return row


async def train_with_retry(spec: dict[str, Any], tag: str, workdir: Path, failures: list[str]) -> dict[str, Any]:
    """`train_watched`, once more (on a fresh redis-server) if the run itself fails: what is
    measured here is what Redis carries, not the workers' robustness; each failure is printed and
    counted in `training_failures`."""
    from bubbletea.launcher.procs import ServiceFailed

    for attempt in range(1, TRAIN_ATTEMPTS + 1):
        try:
            return await train_watched(spec, tag, workdir)
        except ServiceFailed as exc:
            failures.append(f"{tag}: {exc}")
            lines = str(exc).splitlines()
            print(f"  {tag:<6} training run {attempt} FAILED: {lines[0]}", file=sys.stderr)
            for line in lines[1:][-8:]:  # the failed service's last words
                print(f"         | {line[:300]}", file=sys.stderr)
            if attempt == TRAIN_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


async def training_part(iterations: int) -> dict[str, Any]:
    print("Redis carries no tensor: the demo spec trained by the launcher, Redis watched", file=sys.stderr)
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        small = await train_with_retry(demo_spec(False, iterations), "small", Path(tmp), failures)
        large = await train_with_retry(demo_spec(True, iterations), "large", Path(tmp), failures)
    delta = large["peak_mb"] - small["peak_mb"]
    max_entry = max(small["max_entry_bytes"], large["max_entry_bytes"])
    ok = max_entry <= MAX_ENTRY_BYTES and delta <= MAX_PEAK_DELTA_MB
    print(
        f"largest stream entry {max_entry} B (bound {MAX_ENTRY_BYTES}); peak delta {delta:.2f} MiB "
        f"(bound {MAX_PEAK_DELTA_MB:g}): {'no tensor in Redis' if ok else 'TENSORS IN REDIS?'}",
        file=sys.stderr,
    )
    return {
        "max_entry_bytes": max_entry,
        "redis_peak_mb_small": round(small["peak_mb"], 3),
        "redis_peak_mb_large": round(large["peak_mb"], 3),
        "redis_peak_delta_mb": round(delta, 3),
        "no_tensor_in_redis": ok,
        "training_s_small": round(small["seconds"], 1),
        "training_s_large": round(large["seconds"], 1),
        "training_failures": len(failures),
    }


#: Part 3: a KV cache of the demo model (4 layers, d_model 64) for a 256-token prompt: 0.5 MiB.
KV_CACHE_BYTES = 8 * 4 * 256 * 64


def kv_holder_main(url: str, holder: str, ids: list[str], size: int, ready: Any) -> None:
    """A stage worker's KV holder, alone in a process: `ids` held, served until terminated."""

    async def serve() -> None:
        async with Bus(url) as bus:
            shelf = KvShelf(ttl_s=3600, budget_bytes=1 << 34)
            for rid in ids:
                shelf.put(rid, bytes(size), time.time())
            server = KvServer(bus, url, holder, "127.0.0.1", shelf)
            await server.start()
            ready.set()
            await asyncio.Event().wait()

    asyncio.run(serve())


async def kv_part(repeat: int) -> dict[str, Any]:
    """A finished prefill's KV cache to a decoder: over the data plane from its holder process
    (`prefill.kv_store: plane`, a group formed per fetch) against a Redis GET of the same bytes
    (`redis`), each timed in the fetcher from the request to the bytes in hand."""
    print(f"KV cache fetch ({KV_CACHE_BYTES} B): data plane from the holder vs Redis GET", file=sys.stderr)
    ids = [f"kv{i}" for i in range(repeat + WARMUP)]
    ctx = mp.get_context("spawn")
    async with EmbeddedRedis() as server, Bus(server.url) as bus:
        ready = ctx.Event()
        proc = ctx.Process(target=kv_holder_main, args=(server.url, "bench", ids, KV_CACHE_BYTES, ready), daemon=True)
        proc.start()
        try:
            await asyncio.to_thread(ready.wait, 60)
            plane, redis_get = [], []
            await bus.redis.set("bench:kv", bytes(KV_CACHE_BYTES))
            for i, rid in enumerate(ids):
                t0 = time.perf_counter()
                data, why = await kv_plane.fetch(bus, server.url, "bench", rid, "127.0.0.1", "bench")
                t1 = time.perf_counter()
                got = await bus.redis.get("bench:kv")
                t2 = time.perf_counter()
                assert data is not None and len(data) == KV_CACHE_BYTES, why
                assert got is not None and len(got) == KV_CACHE_BYTES
                if i >= WARMUP:
                    plane.append(t1 - t0)
                    redis_get.append(t2 - t1)
        finally:
            proc.terminate()
            proc.join(10)
    p50 = statistics.median(plane) * 1000
    p99 = sorted(plane)[min(len(plane) - 1, math.ceil(0.99 * len(plane)) - 1)] * 1000
    get50 = statistics.median(redis_get) * 1000
    print(f"  plane fetch p50 {p50:.2f} ms, p99 {p99:.2f} ms; Redis GET p50 {get50:.2f} ms", file=sys.stderr)
    return {
        "kv_bytes": KV_CACHE_BYTES,
        "kv_fetch_ms_p50": round(p50, 2),
        "kv_fetch_ms_p99": round(p99, 2),
        "kv_redis_get_ms_p50": round(get50, 2),
    }


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally`: children and servers stop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 timed transfers per size (3 at 64 MiB)")
    ap.add_argument(
        "--repeat", type=int, default=None, metavar="N", help="timed transfers per size (default 20; --quick 5)"
    )
    ap.add_argument(
        "--connections",
        type=int,
        default=4,
        metavar="N",
        help="connections of the extra 64 MiB data-plane measurement (default 4)",
    )
    ap.add_argument(
        "--training",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train the demo spec twice and check that Redis carries no tensor (default: on)",
    )
    ap.add_argument("--iterations", type=int, default=4, help="training iterations per run (default 4)")
    args = ap.parse_args(argv)
    repeat = args.repeat if args.repeat is not None else (5 if args.quick else 20)
    if repeat < 1 or args.connections < 1 or args.iterations < 1:
        ap.error("--repeat, --connections and --iterations must be at least 1")
    repeat_64 = min(repeat, 3) if args.quick else repeat
    signal.signal(signal.SIGTERM, _terminate)

    started = time.perf_counter()
    result: dict[str, Any] = {"bench": "transport"}
    try:
        result.update(transport_part(repeat, repeat_64, args.connections))
        result.update(asyncio.run(kv_part(max(repeat, 20))))
        if args.training:
            result.update(asyncio.run(training_part(args.iterations)))
    except KeyboardInterrupt:
        print("interrupted: receiver, services and redis-servers stopped", file=sys.stderr)
        return 130
    result.update(
        repeat=repeat,
        repeat_64mb=repeat_64,
        warmup=WARMUP,
        connections=args.connections,
        quick=args.quick,
        seconds=round(time.perf_counter() - started, 1),
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
