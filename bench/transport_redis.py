"""Redis carries no tensor: live training runs with Redis watched.

The repo's own launcher (`run_training`: a wan_broker and PP x DP stage-worker processes) trains the
demo spec (configs/demo.yaml, 4 iterations, bubbletea off) twice, each against its own fresh private
redis-server: once with the shipped tiny model (8 KiB activations) and once with d_model 512 x
seq_len 512 (2 MiB activations; 2 layers, one block per stage, under a minute on 2 cores; the WAN
link made fast enough that a 2 MiB activation does not take seconds on the demo's 3.3 Mb/s). A
sampler polls ``INFO memory`` and reads every stream entry as it appears (a ``SCAN ... TYPE
stream`` then XRANGE from each stream's last seen id, several times a second and once at the end,
so entries that the bus trims once acked are seen too). ``max_entry_bytes`` is the largest entry
(sum of field and value lengths) over both runs; ``redis_peak_mb_*`` is Redis's own
``used_memory_peak`` in MiB. If tensors rode Redis, the large run's entries would be >= 2 MiB and
its peak several MiB higher: the claim ``no_tensor_in_redis`` is no entry over 64 KiB and the large
run's peak at most 8 MiB above the small one's. With 4 iterations no checkpoint is due (the demo's
`training.checkpoint_every` is 10); with ``--iterations 10`` or more the workers' checkpoints
(weights and AdamW state, Redis hashes) would count in the peak.

A training run that fails fails the benchmark (exit status 1, no JSON line; ``training_failures``
is 0 in every JSON line printed). ``valid``: both runs trained every iteration to a finite loss and
the sampler saw stream entries in both (with none seen, ``max_entry_bytes`` would prove nothing);
``why`` says what was missing.

    python bench/transport_redis.py                    # 2 runs of 4 iterations (1-2 minutes on 2 cores)
    python bench/transport_redis.py --quick            # the same: the runs are already as short as they go
    python bench/transport_redis.py --iterations 10    # checkpoints too

Human-readable lines on stderr, then one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import io
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import yaml

from bench.lib.children import stop_on_sigterm
from bench.lib.output import emit, stderr, verdict
from bench.lib.transfers import MIB
from shared.bus.connection import client_for
from shared.runtime.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent

#: `no_tensor_in_redis` bounds: no stream entry over 64 KiB, and the 2 MiB-activation run's Redis
#: peak at most this many MiB above the tiny model's.
MAX_ENTRY_BYTES = 65536
MAX_PEAK_DELTA_MB = 8.0


class RedisSampler:
    """Polls INFO memory and reads every stream entry as it appears (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.r = client_for(url)
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
    """One training run on a fresh redis-server, watched; a failed run's last words are printed
    and its `ServiceFailed` raised (what is measured is what Redis carries, so a failure is fatal)."""
    from bubbletea.launcher.procs import ServiceFailed
    from bubbletea.launcher.train import run_training
    from shared.config.settings import load_settings

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
        except ServiceFailed as exc:
            lines = str(exc).splitlines()
            stderr(f"  {tag:<6} training run FAILED: {lines[0]}")
            for line in lines[1:][-8:]:  # the failed service's last words
                stderr(f"         | {line[:300]}")
            raise
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
        "losses": result.losses,
        "iteration_s": result.steady_iteration_s(),
    }
    stderr(
        f"  {tag:<6} activations {activation_mib(spec):6.3f} MiB  {len(result.losses)} iterations in {elapsed:5.1f} s "
        f"(steady {row['iteration_s']:.2f} s each, loss {result.losses[-1]:.3f})  redis peak {row['peak_mb']:6.2f} "
        f"MiB  largest of {row['entries']} stream entries {row['max_entry_bytes']} B ({row['max_entry_stream']})"
    )
    return row


def problems_of(tag: str, row: dict[str, Any], iterations: int) -> list[str]:
    """What makes a run's figures prove nothing (see ``valid`` in the module docstring)."""
    out = []
    if len(row["losses"]) != iterations or not all(math.isfinite(x) for x in row["losses"]):
        out.append(f"{tag}: {len(row['losses'])} of {iterations} iterations, losses {row['losses']}")
    if row["entries"] == 0:
        out.append(f"{tag}: the sampler saw no stream entry")
    return out


async def run(iterations: int) -> dict[str, Any]:
    """Every figure, ``no_tensor_in_redis``, ``valid`` and ``why``."""
    stderr("Redis carries no tensor: the demo spec trained by the launcher, Redis watched")
    with tempfile.TemporaryDirectory() as tmp:
        small = await train_watched(demo_spec(False, iterations), "small", Path(tmp))
        large = await train_watched(demo_spec(True, iterations), "large", Path(tmp))
    delta = large["peak_mb"] - small["peak_mb"]
    max_entry = max(small["max_entry_bytes"], large["max_entry_bytes"])
    ok = max_entry <= MAX_ENTRY_BYTES and delta <= MAX_PEAK_DELTA_MB
    stderr(
        f"largest stream entry {max_entry} B (bound {MAX_ENTRY_BYTES}); peak delta {delta:.2f} MiB "
        f"(bound {MAX_PEAK_DELTA_MB:g}): {'no tensor in Redis' if ok else 'TENSORS IN REDIS?'}"
    )
    problems = problems_of("small", small, iterations) + problems_of("large", large, iterations)
    seen = f"{small['entries']} + {large['entries']} stream entries seen"
    return {
        "max_entry_bytes": max_entry,
        "redis_peak_mb_small": round(small["peak_mb"], 3),
        "redis_peak_mb_large": round(large["peak_mb"], 3),
        "redis_peak_delta_mb": round(delta, 3),
        "no_tensor_in_redis": ok,
        "training_s_small": round(small["seconds"], 1),
        "training_s_large": round(large["seconds"], 1),
        "training_failures": 0,  # a failed run raised: no JSON line
        **verdict(problems, f"both runs trained {iterations} iterations to a finite loss; {seen}"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the same run (it is already as short as it goes)")
    ap.add_argument("--iterations", type=int, default=4, help="training iterations per run (default 4)")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error("--iterations must be at least 1")
    stop_on_sigterm()
    started = time.perf_counter()
    try:
        result = {"bench": "transport_redis", **asyncio.run(run(args.iterations))}
    except KeyboardInterrupt:
        stderr("interrupted: services and redis-servers stopped")
        return 130
    result.update(iterations=args.iterations, quick=args.quick, seconds=round(time.perf_counter() - started, 1))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
