"""BubbleTea benchmark: the same training run with prefill in its bubbles off, then on.

Both runs use the same spec and seed (WAN-bound, with a device profile: configs/wan-bound.yaml)
over real services on a private redis-server. With BubbleTea on, the load generator (its own
process) keeps `--concurrency` prefill requests in flight over real HTTP (`POST /v1/completions`)
for most of the run, so requests are always waiting when a bubble opens.

    python bench/bubble_fill.py            # 16 iterations per run
    python bench/bubble_fill.py --quick    # under 60 s

Prints a table, then one JSON object on the last line. Keys:
dispatch_p50_ms / dispatch_p99_ms (bubble start on the worker -> its first prefill running),
bubble_fill_ratio (prefill time / bubble time), utilization_off / utilization_on (training +
prefill time / wall time, mean over workers), train_slowdown_pct (steady iteration time, on vs
off), prefill_tokens_per_s, ttft_p50_ms / ttft_p99_ms (HTTP request to answer), requests_lost
(accepted but neither answered nor failed explicitly).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
import yaml
from redis.asyncio import Redis

from bubbletea.launcher.load import run_loadgen
from bubbletea.launcher.procs import spawn, stop_all, wait_http_healthy
from bubbletea.launcher.services import PREFILL_QUEUE
from bubbletea.launcher.train import TrainResult, run_training
from bubbletea.runstats import dispatch_latencies_ms, median, percentile, run_spans, utilization
from shared.redis_server import EmbeddedRedis, free_port
from shared.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = yaml.safe_load((ROOT / "configs" / "wan-bound.yaml").read_text())


def bench_spec(*, enabled: bool, iterations: int, dp: int) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec["name"] = "bubbletea-bench"
    spec["parallelism"]["dp"] = dp
    spec["training"]["iterations"] = iterations
    spec["bubbletea"] = {"enabled": enabled, "guard_ms": 2.0, "dispatch_overhead_ms": 1.0, "max_batch_requests": 16}
    spec["prefill"] = {
        "model": {"layers": 4, "d_model": 64, "heads": 4, "seq_len": 256, "vocab": 256, "seed": 0},
        "max_prompt_tokens": 256,
        # Unanswered requests fail explicitly 5 s after the run: the benchmark's tail stays short.
        "request_timeout_s": 5,
        # KV caches are not kept: at benchmark throughput they would be hundreds of MB per second.
        "kv_ttl_s": 0,
    }
    return spec


async def load(api: str, url: str, run: str, concurrency: int, duration_s: float, out: Path) -> dict[str, Any]:
    """The load generator: `concurrency` requests always in flight (closed loop), from the run's
    first bubble on, for `duration_s`."""
    args = ["--base-url", api, "--request-rate", "inf", "--max-concurrency", str(concurrency)]
    args += ["--duration", f"{duration_s:.2f}", "--num-prompts", "1000000", "--input-len", "96"]
    args += ["--range-ratio", "0.33", "--seed", "1"]
    return await run_loadgen(url, run, args, out)


async def one_run(
    url: str, workdir: Path, *, enabled: bool, iterations: int, dp: int, concurrency: int, load_s: float = 0.0
) -> tuple[TrainResult, dict[str, Any]]:
    spec = bench_spec(enabled=enabled, iterations=iterations, dp=dp)
    path = workdir / f"bt-{'on' if enabled else 'off'}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run = f"bench-bt-{'on' if enabled else 'off'}-{random.randrange(1 << 30):x}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    out = io.StringIO()
    extra: dict[str, Any] = {}
    if not enabled:
        result = await run_training(settings, url, out=out, progress=False, quiet=True)
    else:
        port = free_port()
        env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_HTTP_PORT": str(port)}
        door = await spawn(PREFILL_QUEUE, env, out=out, quiet=True)
        try:
            base = f"http://127.0.0.1:{port}"
            await wait_http_healthy(door, base)
            client = asyncio.create_task(load(base, url, run, concurrency, load_s, workdir / "loadgen.json"))
            result = await run_training(settings, url, out=out, progress=False, quiet=True, dispatcher=True)
            extra = {"load": await client}
        finally:
            await stop_all([door])
    r = Redis.from_url(url)
    try:
        spans = await run_spans(r, run)
    finally:
        await r.aclose()
    return result, {"spans": spans, **extra}


async def bench(quick: bool, dp: int, concurrency: int) -> dict[str, Any]:
    iterations = 8 if quick else 16
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis() as redis:
            off, off_t = await one_run(
                redis.url, Path(tmp), enabled=False, iterations=iterations, dp=dp, concurrency=concurrency
            )
            # the load lasts most of the training time (measured with BubbleTea off), not its tail
            load_s = 0.8 * sum(off.iteration_s)
            on, on_t = await one_run(
                redis.url, Path(tmp), enabled=True, iterations=iterations, dp=dp, concurrency=concurrency, load_s=load_s
            )
    u_off, u_on = utilization(off_t["spans"]), utilization(on_t["spans"])
    dispatch = dispatch_latencies_ms(on_t["spans"])
    lg: dict[str, Any] = on_t["load"]
    ttft = lg["ttfts_ms"]
    it_off, it_on = off.steady_iteration_s(), on.steady_iteration_s()
    return {
        "iterations": iterations,
        "dp": dp,
        "concurrency": concurrency,
        "iter_ms_off": round(it_off * 1000, 2),
        "iter_ms_on": round(it_on * 1000, 2),
        "train_slowdown_pct": round((it_on / it_off - 1) * 100, 2),
        # how far real compute fell behind the device profile, summed over workers and iterations
        "lag_ms_off": round(off.lag_ms, 1),
        "lag_ms_on": round(on.lag_ms, 1),
        "bubble_fraction_off": round(u_off.bubble, 3),
        "utilization_off": round(u_off.busy, 3),
        "utilization_on": round(u_on.busy, 3),
        "bubble_fill_ratio": round(u_on.fill_ratio, 3),
        "dispatch_p50_ms": _r(median(dispatch)),
        "dispatch_p99_ms": _r(percentile(dispatch, 99)),
        "bubbles_dispatched": len(dispatch),
        "prefill_tokens_per_s": round(lg["input_throughput"], 1),
        "requests_answered": lg["completed"],
        "ttft_p50_ms": _r(median(ttft)),
        "ttft_p99_ms": _r(percentile(ttft, 99)),
        "errors": lg["errors"],
        # accepted but never answered nor failed explicitly (an HTTP status is an explicit answer)
        "requests_lost": sum(n for k, n in lg["errors"].items() if not k.isdigit()),
        "losses_equal": off.losses == on.losses,
    }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 iterations per run; finishes in under 60 s")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel replicas (workers = 2 x DP); default 2")
    ap.add_argument("--concurrency", type=int, default=32, help="requests the client keeps in flight; default 32")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = uvloop.run(bench(args.quick, args.dp, args.concurrency))
    res["bench_s"] = round(time.perf_counter() - t0, 1)
    for k, v in res.items():
        print(f"{k:<24} {v}", file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
