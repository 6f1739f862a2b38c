"""BubbleTea benchmark: the same training run with prefill in its bubbles off, then on.

Both runs use the same spec and seed (WAN-bound, with a device profile: configs/wan-bound.yaml)
over real services on a private redis-server. With BubbleTea on, a closed-loop client keeps
`--concurrency` prefill requests in flight over real HTTP (`POST /v1/completions`) for the whole
run, so requests are always waiting when a bubble opens.

    python bench/bubbletea.py            # 16 iterations per run
    python bench/bubbletea.py --quick    # under 60 s

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from redis.asyncio import Redis

from shared.launcher.procs import spawn, stop_all, wait_http_healthy
from shared.launcher.services import PREFILL_QUEUE
from shared.launcher.train import TrainResult, run_training
from shared.redis_server import EmbeddedRedis, free_port
from shared.runstats import dispatch_latencies_ms, median, percentile, run_spans, utilization
from shared.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = yaml.safe_load((ROOT / "configs" / "wan-bound.yaml").read_text())
#: Requests still unanswered this long after their deadline count as lost.
LOST_AFTER_S = 10.0


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


@dataclass
class Load:
    """A closed-loop client: `concurrency` requests in flight until `stop` is set."""

    url: str
    concurrency: int
    seed: int
    min_tokens: int = 64
    max_tokens: int = 128
    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    lost: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, stop, i) for i in range(self.concurrency)))

    async def _client(self, http: aiohttp.ClientSession, stop: asyncio.Event, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not stop.is_set():
            prompt = [rng.randrange(256) for _ in range(rng.randint(self.min_tokens, self.max_tokens))]
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(5 + LOST_AFTER_S):
                    async with http.post(
                        f"{self.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0}
                    ) as resp:
                        await resp.read()
                        status = resp.status
            except (aiohttp.ClientError, TimeoutError):
                self.lost += 1  # accepted or not, the client never heard back
                continue
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            if status == 200:
                self.ttft_ms.append((time.perf_counter() - t0) * 1000)
                self.prompt_tokens += len(prompt)


async def one_run(
    url: str, workdir: Path, *, enabled: bool, iterations: int, dp: int, concurrency: int
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
            load, stop = Load(base, concurrency, seed=1), asyncio.Event()
            client = asyncio.create_task(load.run(stop))
            t0 = time.perf_counter()
            result = await run_training(settings, url, out=out, progress=False, quiet=True, dispatcher=True)
            duration = time.perf_counter() - t0
            stop.set()
            await client  # in-flight requests: answered, or failed explicitly at their deadline
        finally:
            await stop_all([door])
        extra = {"load": load, "duration_s": duration}
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
            runs = [
                await one_run(redis.url, Path(tmp), enabled=on, iterations=iterations, dp=dp, concurrency=concurrency)
                for on in (False, True)
            ]
    (off, off_t), (on, on_t) = runs
    u_off, u_on = utilization(off_t["spans"]), utilization(on_t["spans"])
    dispatch = dispatch_latencies_ms(on_t["spans"])
    load: Load = on_t["load"]
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
        "prefill_tokens_per_s": round(load.prompt_tokens / on_t["duration_s"], 1),
        "requests_answered": len(load.ttft_ms),
        "ttft_p50_ms": _r(median(load.ttft_ms)),
        "ttft_p99_ms": _r(percentile(load.ttft_ms, 99)),
        "http_statuses": load.statuses,
        "requests_lost": load.lost + sum(n for s, n in load.statuses.items() if s not in ("200", "504", "429")),
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
