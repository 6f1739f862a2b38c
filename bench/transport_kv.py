"""KV cache fetch: a finished prefill's KV cache to a decoder, over the data plane against Redis.

A 0.5 MiB KV cache (the demo model: 4 layers, d_model 64, a 256-token prompt) is fetched by a
decoder (this process, a `KvClient`) from its holder, a separate process running a stage worker's
`KvServer` over a `KvShelf` under uvloop as a worker does, over the data plane
(`shared.dataplane.kv`, "bubbletea-kv-wire/1": one TCP connection kept per holder and fetcher, as
``prefill.kv_store: plane`` does), against a Redis GET of the same bytes. Each is timed in the
fetcher from the request to the bytes in hand; 2 warm-up fetches (the first opens the connection),
then N timed ones: ``kv_fetch_ms_p50``, ``kv_fetch_ms_p99`` (nearest rank),
``kv_redis_get_ms_p50``; ``kv_connections``: the connections the fetcher opened (1: every fetch
after the first reused it). Then the same fetches by the vLLM connector's own client
(`bubbletea_vllm.kvclient`: blocking, standard library, what a vLLM worker runs):
``kv_fetch_connector_ms_p50`` and ``_p99``.

``valid``: every fetch, warm-ups included, returned the very bytes the holder holds for that
request (each cache has contents of its own), every GET the bytes set, and the fetcher opened one
connection; ``why`` says which did not.

    python bench/transport_kv.py            # 50 timed fetches
    python bench/transport_kv.py --quick    # 20

Human-readable lines on stderr, then one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import uvloop
from bubbletea_vllm.kvclient import KvClient as ConnectorClient

from bench.lib.children import spawn_child, stop_child, stop_on_sigterm
from bench.lib.output import emit, stderr, verdict
from bench.lib.transfers import WARMUP
from shared.bus import Bus
from shared.dataplane.kv import KvServer, KvShelf
from shared.dataplane.kv_client import KvClient
from shared.figures.percentiles import percentile
from shared.runtime.redis_server import EmbeddedRedis

#: A KV cache of the demo model (4 layers, d_model 64; K and V, float32) for a 256-token prompt.
KV_CACHE_BYTES = 8 * 4 * 256 * 64


def cache_bytes(rid: str, size: int) -> bytes:
    """The cache held for request `rid`: its name repeated (every cache differs from every other)."""
    unit = f"{rid}|".encode()
    return (unit * (size // len(unit) + 1))[:size]


def holder_main(ids: list[str], size: int, ready: Any) -> None:
    """A stage worker's KV holder, alone in a process: `ids` held, served until terminated; its
    address ("host:port") is put on `ready` once it listens."""

    async def serve() -> None:
        shelf = KvShelf(ttl_s=3600, budget_bytes=1 << 34)
        for rid in ids:
            shelf.put(rid, cache_bytes(rid, size), time.time())
        server = KvServer(shelf, "127.0.0.1")
        ready.put(await server.start())
        await asyncio.Event().wait()

    uvloop.run(serve())


async def run(repeat: int) -> dict[str, Any]:
    """Every figure, ``valid`` and ``why``."""
    stderr(f"KV cache fetch ({KV_CACHE_BYTES} B): data plane from the holder (kept connection) vs Redis GET")
    ids = [f"kv{i}" for i in range(repeat + WARMUP)]
    problems: list[str] = []
    plane, redis_get = [], []
    client = KvClient()
    async with EmbeddedRedis() as server, Bus(server.url) as bus:
        ready = mp.get_context("spawn").Queue()
        proc = spawn_child(holder_main, (ids, KV_CACHE_BYTES, ready), "kv-holder")
        try:
            try:
                holder = await asyncio.to_thread(ready.get, True, 60)
            except queue.Empty:
                raise TimeoutError("the KV holder was not serving within 60 s") from None
            connector = await asyncio.to_thread(_connector_fetches, holder, ids, problems)
            expected_get = cache_bytes("redis", KV_CACHE_BYTES)
            await bus.redis.set("bench:kv", expected_get)
            for i, rid in enumerate(ids):
                t0 = time.perf_counter()
                data, why = await client.fetch(holder, rid)
                t1 = time.perf_counter()
                got = await bus.redis.get("bench:kv")
                t2 = time.perf_counter()
                if data != cache_bytes(rid, KV_CACHE_BYTES):
                    problems.append(f"fetch {rid}: " + (why or f"{len(data or b'')} B, not its cache"))
                if got != expected_get:
                    problems.append(f"GET {i}: {len(got or b'')} B, not the bytes set")
                if i >= WARMUP:
                    plane.append(t1 - t0)
                    redis_get.append(t2 - t1)
        finally:
            await client.close()
            stop_child(proc, 0)
    if client.connects != 1:
        problems.append(f"the fetcher opened {client.connects} connections to the holder, not 1")
    p50, p99 = statistics.median(plane) * 1000, _p99_ms(plane)
    get50 = statistics.median(redis_get) * 1000
    c50, c99 = statistics.median(connector) * 1000, _p99_ms(connector)
    stderr(f"  plane fetch p50 {p50:.2f} ms, p99 {p99:.2f} ms; Redis GET p50 {get50:.2f} ms")
    stderr(f"  the vLLM connector's client: p50 {c50:.2f} ms, p99 {c99:.2f} ms")
    return {
        "kv_bytes": KV_CACHE_BYTES,
        "kv_fetch_ms_p50": round(p50, 2),
        "kv_fetch_ms_p99": round(p99, 2),
        "kv_redis_get_ms_p50": round(get50, 2),
        "kv_connections": client.connects,
        "kv_fetch_connector_ms_p50": round(c50, 2),
        "kv_fetch_connector_ms_p99": round(c99, 2),
        **verdict(problems, f"all {len(ids)} fetches and GETs returned their exact bytes, on one connection"),
    }


def _p99_ms(seconds: list[float]) -> float:
    value = percentile(seconds, 99)
    assert value is not None, "no timed fetch"
    return value * 1000


def _connector_fetches(holder: str, ids: list[str], problems: list[str]) -> list[float]:
    """The fetches of `ids` by the vLLM connector's blocking client (in a thread): timed after warm-up."""
    client = ConnectorClient()
    times = []
    try:
        for i, rid in enumerate(ids):
            t0 = time.perf_counter()
            data = client.fetch(holder, rid)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
            if data != cache_bytes(rid, KV_CACHE_BYTES):
                problems.append(f"connector fetch {rid}: {len(data)} B, not its cache")
    finally:
        client.close()
    if client.connects != 1:
        problems.append(f"the connector's client opened {client.connects} connections, not 1")
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 timed fetches")
    ap.add_argument("--repeat", type=int, metavar="N", help="timed fetches (default 50; --quick 20)")
    args = ap.parse_args(argv)
    repeat = args.repeat if args.repeat is not None else (20 if args.quick else 50)
    if repeat < 1:
        ap.error("--repeat must be at least 1")
    stop_on_sigterm()
    started = time.perf_counter()
    try:
        result = {"bench": "transport_kv", **asyncio.run(run(repeat))}
    except KeyboardInterrupt:
        stderr("interrupted: holder and redis-server stopped")
        return 130
    result.update(repeat=repeat, warmup=WARMUP, quick=args.quick, seconds=round(time.perf_counter() - started, 1))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
