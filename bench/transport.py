"""The three transport benchmarks in one run, as one JSON line (the command line this file always had).

1. bench/transport_throughput.py: one tensor (1, 16, 64 MiB) from one process to another over a Redis
   stream, the data plane (gloo) and a raw socket: ``*_GBps_*``, ``ratio_vs_redis_64mb``,
   ``ratio_vs_socket_64mb``, ``targets_met``;
2. bench/transport_kv.py: a 0.5 MiB KV cache fetched from its holder over the data plane (one kept
   TCP connection, "bubbletea-kv-wire/1") against a Redis GET: ``kv_fetch_ms_p50``,
   ``kv_fetch_ms_p99``, ``kv_redis_get_ms_p50``, ``kv_connections``; its timed fetches are
   max(``--repeat``, 20);
3. bench/transport_redis.py (``--training``, on by default): the demo spec trained twice (8 KiB and
   2 MiB activations) while Redis is watched: ``max_entry_bytes``, ``redis_peak_mb_*``,
   ``no_tensor_in_redis``.

Each script's docstring says what it measures and how. The JSON line holds every figure of the
three; ``valid`` is true when every part's is, and ``why`` gives each part's, named.

    python bench/transport.py                 # full run (2-4 minutes on 2 cores)
    python bench/transport.py --quick         # fewer transfers
    python bench/transport.py --no-training   # parts 1 and 2 only
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import transport_kv
import transport_redis
import transport_throughput

from bench.lib.children import stop_on_sigterm
from bench.lib.output import emit, stderr
from bench.lib.transfers import WARMUP


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    transport_throughput.add_args(ap)
    ap.add_argument(
        "--training",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train the demo spec twice and check that Redis carries no tensor (default: on)",
    )
    ap.add_argument("--iterations", type=int, default=4, help="training iterations per run (default 4)")
    args = ap.parse_args(argv)
    repeat, repeat_64 = transport_throughput.repeats(ap, args)
    if args.iterations < 1:
        ap.error("--iterations must be at least 1")
    stop_on_sigterm()

    started = time.perf_counter()
    parts: dict[str, dict[str, Any]] = {}
    try:
        parts["throughput"] = transport_throughput.run(repeat, repeat_64, args.connections)
        parts["kv"] = asyncio.run(transport_kv.run(max(repeat, 20)))
        if args.training:
            parts["redis"] = asyncio.run(transport_redis.run(args.iterations))
    except KeyboardInterrupt:
        stderr("interrupted: receiver, services and redis-servers stopped")
        return 130
    result: dict[str, Any] = {"bench": "transport"}
    verdicts = [(name, part.pop("valid"), part.pop("why")) for name, part in parts.items()]
    for part in parts.values():
        result.update(part)
    result.update(
        valid=all(valid for _, valid, _ in verdicts),
        why="; ".join(f"{name}: {why}" for name, _, why in verdicts),
        repeat=repeat,
        repeat_64mb=repeat_64,
        warmup=WARMUP,
        connections=args.connections,
        quick=args.quick,
        seconds=round(time.perf_counter() - started, 1),
    )
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
