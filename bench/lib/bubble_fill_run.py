"""One run of bench/bubble_fill.py: its spec, its open-loop load, the services, and what the run recorded."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import yaml

from bench.lib import sim_fit
from bench.lib.cpu_shares import CpuSampler
from bubbletea.launcher.load import run_loadgen
from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import TrainResult, run_training
from shared.bus.connection import client_for
from shared.config.settings import load_settings
from shared.figures.bubblestats import empty_with_work, run_control
from shared.figures.runstats import run_spans, write_spans
from shared.policies.spans import Span
from shared.wire import ControlSeen

if TYPE_CHECKING:
    from bench.lib.gpu_job import Prepared

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((ROOT / "configs" / "wan-bound.yaml").read_text())


#: The profiled mode's prefill cost per block (one layer of one prompt): ~1 ms for the load's
#: ~96-token prompts, and 2-3x this CPU's real compute for the benchmark's model.
PREFILL_PROFILE = {"prefill_ms_per_layer": 0.25, "prefill_us_per_token": 8.0}
#: profiled: the training profile and the prefill profile; raw: the training profile, prefill for its
#: real compute; real: no profile at all (training and prefill for their real compute, on the GPU
#: when there is one: `bench/gpu_check.py`, not one of the default cases).
MODES = ("profiled", "raw")
ALL_MODES = (*MODES, "real")


def bench_spec(
    *,
    enabled: bool,
    iterations: int,
    dp: int,
    mode: str = "profiled",
    slo_device_ms: float = 1000.0,
    job: Prepared | None = None,
    dispatch: str = "one",
) -> dict[str, Any]:
    """The bench's spec: configs/wan-bound.yaml's pipeline, or with `job` (real mode) the GPU
    check's Llama job (bench/lib/gpu_job.py); `dispatch`: `bubbletea.dispatch` (one, per_dc)."""
    spec = copy.deepcopy(BASE)
    if mode == "profiled":
        spec["device"] |= PREFILL_PROFILE
    elif mode == "real":
        spec["device"] = {"kind": "auto"}
    spec["name"] = "bubbletea-bench"
    spec["parallelism"]["dp"] = dp
    spec["training"]["iterations"] = iterations
    spec["bubbletea"] = {"enabled": enabled, "max_batch_requests": 16, "dispatch": dispatch}
    spec["prefill"] = {
        "model": {"layers": 4, "d_model": 64, "heads": 4, "seq_len": 256, "vocab": 256, "seed": 0},
        "max_prompt_tokens": 256,
        # A request's deadline is the TTFT objective (device time, stretched by k like the bubbles):
        # one the bubbles could not start in time is refused at once (429), not queued to expire.
        "request_timeout_s": slo_device_ms / 1000,
        # KV caches are not kept: at benchmark throughput they would be hundreds of MB per second.
        "kv_ttl_s": 0,
    }
    if job is not None:
        for section, values in job.overrides.items():
            spec[section] = values if section in ("wan", "model") else {**spec[section], **values}
    return spec


#: The load's prompts: 96 tokens on average (64-128), as `load` asks the load generator for.
PROMPT_TOKENS = 96


async def load(api: str, rate: float, duration_s: float, out: Path, job: Prepared | None = None) -> dict[str, Any]:
    """The load generator: Poisson arrivals at `rate` requests per (real) second, open loop (no
    cap on requests in flight), from the moment training runs (`/ready` says serving: not while the
    workers set up, whose queue would reach the first bubbles as a burst, not at the stated rate),
    for `duration_s`."""
    args = ["--base-url", api, "--request-rate", f"{rate:.4f}", "--burstiness", "1", "--ready-state", "serving"]
    args += ["--duration", f"{duration_s:.2f}", "--num-prompts", "1000000", "--seed", str(random.randrange(1 << 30))]
    args += job.load_args() if job is not None else ["--input-len", str(PROMPT_TOKENS), "--range-ratio", "0.33"]
    return await run_loadgen(args, out)


async def one_run(
    url: str,
    workdir: Path,
    *,
    enabled: bool,
    iterations: int,
    dp: int,
    mode: str,
    slo_device_ms: float,
    rate: float = 0.0,
    load_s: float = 0.0,
    dump: Path | None = None,
    job: Prepared | None = None,
    record: bool = False,
    dispatch: str = "one",
) -> tuple[TrainResult, dict[str, Any]]:
    """One training run, BubbleTea off or on (then under the load: `rate` requests per real second
    for `load_s`); with `dump` (`--dump DIR`) its spans and the dispatcher's records are written
    there too; with `record` (BubbleTea on) the requests accepted and the batch reports are kept
    (`sim_fit.record`, in `recorded`), and the spec (`spec`)."""
    kw: dict[str, Any] = {"mode": mode, "slo_device_ms": slo_device_ms, "job": job, "dispatch": dispatch}
    spec = bench_spec(enabled=enabled, iterations=iterations, dp=dp, **kw)
    path = workdir / f"bt-{'on' if enabled else 'off'}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run = f"bench-bt-{'on' if enabled else 'off'}-{random.randrange(1 << 30):x}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    out = io.StringIO()
    extra: dict[str, Any] = {}
    launched = time.monotonic()
    if not enabled:
        result = await run_training(settings, url, out=out, progress=False, quiet=True)
    else:
        env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_RUN": run}  # the dispatcher's run
        sampler = CpuSampler()
        sampling = asyncio.create_task(sampler.run())
        recorded: list[Any] = []
        watching = sim_fit.record(url, run, recorded) if record else None
        try:
            async with front_door(env, out=out) as door:
                assert door.url is not None
                client = asyncio.create_task(load(door.url, rate, load_s, workdir / "loadgen.json", job))
                # trains on past the spec's iterations until the load is done (those are left out
                # below): every bubble of the spec's iterations has requests waiting, the last too
                result = await run_training(
                    settings, url, out=out, progress=False, quiet=True, dispatcher=True, until=client
                )
                extra = {"load": await client}
        finally:
            for task in (sampling, watching):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        extra["cpu"] = sampler.shares()
        if record:
            extra |= {"recorded": recorded, "spec": spec}
    extra["wall_s"] = time.monotonic() - launched
    r = client_for(url, protocol=None)
    try:
        spans = [s for s in await run_spans(r, run) if s.iteration < iterations]
        seen = [c for c in await run_control(r, run) if c.at <= max((s.end for s in spans), default=0.0)]
    finally:
        await r.aclose()
    if dump is not None:  # --dump: every span and record of the run, for a person to look into
        await asyncio.to_thread(_dump, dump, run, spans, seen)
    return result, {"spans": spans, "seen": seen, **extra}


def _dump(folder: Path, run: str, spans: list[Span], seen: list[ControlSeen]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_spans(folder / f"{run}.spans.jsonl", spans, full=True)
    (folder / f"{run}.control.jsonl").write_text("".join(json.dumps(msgspec.to_builtins(c)) + "\n" for c in seen))
    empty = empty_with_work(spans, seen)  # had work, stayed empty: predicted against actual length
    (folder / f"{run}.empty_bubbles.jsonl").write_text("".join(json.dumps(b) + "\n" for b in empty))
