"""The simulator against the live system: the same specs run live and simulated, figure by figure.

Each case is one spec with one WAN sharing policy, BubbleTea off or on. Live, it is a real
training run (`bubbletea.launcher.train.run_training`: the broker and PP x DP stage workers as
processes on a private redis-server; with BubbleTea on also the front door, the dispatcher and the
load generator, as `bubbletea demo` runs them). Simulated, it is `sim.run.run_off` / `run_on` on
the very same spec. With BubbleTea on both get the same load: the load generator's Poisson arrivals
at the demo's rate and prompt lengths (`--request-rate`, 96 tokens +-50%), and the simulator replays
exactly the requests the load generator sends (its seeded arrival and prompt streams), shifted so
that the first one arrives where it arrived live, relative to the steady window.

Every figure comes from `bubbletea.runstats` on each side's spans (steady iteration time as
`bubbletea train` reports it); per case and overall the relative error |sim - live| / live of the
iteration time, the bubble fraction and (BubbleTea on) the fill ratio.

    python bench/sim_vs_live.py                    # demo and wan-bound, fair and temporal, off and on
    python bench/sim_vs_live.py --quick            # fewer iterations and cases (a few minutes)
    python bench/sim_vs_live.py --config FILE      # any spec (with a device profile), fair and temporal

Prints a table, then one JSON line last (keys ending in `_rel_err`, `max_rel_err`; `lag_ms`: how
far live compute fell behind the device profile, summed over workers and iterations).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import uvloop
import yaml
from redis.asyncio import Redis

from bubbletea import runstats
from bubbletea.launcher.demo import LOAD_INPUT_LEN, LOAD_RANGE_RATIO, LOAD_RATE_PER_S
from bubbletea.launcher.load import run_loadgen
from bubbletea.launcher.procs import spawn, stop_all, wait_http_healthy
from bubbletea.launcher.services import PREFILL_QUEUE
from bubbletea.launcher.train import TrainResult, run_training
from loadgen.arrivals import arrival_offsets
from loadgen.cli import ARRIVAL_STREAM, PROMPT_STREAM, stream_rng
from loadgen.datasets import random_prompts
from shared import keys
from shared.config import ClusterSpec, load_spec
from shared.redis_server import EmbeddedRedis, free_port
from shared.settings import load_settings
from sim.run import run_off, run_on
from sim.setup import DEFAULT_PREFILL, build

ROOT = Path(__file__).resolve().parent.parent
SPECS = (ROOT / "configs" / "demo.yaml", ROOT / "configs" / "wan-bound.yaml")
SHARINGS = ("fair", "temporal")
#: A live request still queued when training ends fails at its deadline; the load generator waits
#: for it. 5 s keeps each run's tail short (the figures are over the training window only).
REQUEST_TIMEOUT_S = 5
SEED = 0
FIGURES = ("iteration", "bubble_fraction", "fill_ratio")
#: How long to wait for the load's first request (the load starts at the run's first bubble).
FIRST_REQUEST_TIMEOUT_MS = 300_000


@dataclass(frozen=True)
class Case:
    spec: Path
    sharing: str
    bubbletea: bool

    @property
    def name(self) -> str:
        return f"{self.spec.stem}-{self.sharing}-{'on' if self.bubbletea else 'off'}"


def case_spec(case: Case, iterations: int | None) -> dict[str, Any]:
    """The spec of one case, as plain data (written to a file for the live services)."""
    raw: dict[str, Any] = msgspec.to_builtins(load_spec(case.spec))
    raw["wan"]["sharing"] = case.sharing
    raw["bubbletea"]["enabled"] = case.bubbletea
    raw["prefill"]["request_timeout_s"] = REQUEST_TIMEOUT_S
    if iterations is not None:
        raw["training"]["iterations"] = iterations
    if raw["device"].get("prefill_ms_per_layer") is None:  # else live prefill counts for raw CPU time,
        # which the simulator cannot know: both sides get the profile the simulator assumes
        raw["device"]["prefill_ms_per_layer"] = round(DEFAULT_PREFILL.fixed_s * 1000, 6)
        raw["device"]["prefill_us_per_token"] = round(DEFAULT_PREFILL.per_token_s * 1e6, 6)
    return raw


@dataclass
class Live:
    train: TrainResult
    spans: list[runstats.Span]
    first_request: float | None  # wall clock: the first request reaching the front door


def load_plan(rate: float, duration_s: float) -> list[tuple[float, int]]:
    """Exactly what the load generator sends with these options and SEED: (offset s, prompt tokens)."""
    offsets = arrival_offsets(rate, 1.0, stream_rng(SEED, ARRIVAL_STREAM))
    prompts = random_prompts(LOAD_INPUT_LEN, LOAD_RANGE_RATIO, stream_rng(SEED, PROMPT_STREAM))
    plan = zip(offsets, (len(p) for p in prompts), strict=False)
    return list(itertools.takewhile(lambda r: r[0] < duration_s, plan))


async def first_entry_time(url: str, stream: str) -> float | None:
    """Wall-clock time (s) of the next entry published on `stream` (its Redis id's milliseconds)."""
    r = Redis.from_url(url, socket_timeout=None)
    try:
        reply: Any = await r.xread({stream: "$"}, count=1, block=FIRST_REQUEST_TIMEOUT_MS)
        return int(reply[0][1][0][0].decode().split("-")[0]) / 1000 if reply else None
    finally:
        await r.aclose()


async def run_live(spec: dict[str, Any], url: str, workdir: Path, *, rate: float, load_s: float) -> Live:
    tag = f"svl-{spec['name']}-{random.randrange(1 << 30):x}"
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    settings = load_settings(path, env={"BUBBLETEA_RUN": tag})
    out = io.StringIO()
    first: float | None = None
    if not spec["bubbletea"]["enabled"]:
        result = await run_training(settings, url, out=out, progress=False, quiet=True)
    else:
        port = free_port()
        env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_HTTP_PORT": str(port)}
        door = await spawn(PREFILL_QUEUE, env, out=out, quiet=True)
        try:
            base = f"http://127.0.0.1:{port}"
            await wait_http_healthy(door, base)
            seen = asyncio.create_task(first_entry_time(url, keys.PREFILL_REQUESTS_STREAM))
            args = ["--base-url", base, "--request-rate", f"{rate:g}", "--duration", f"{load_s:.2f}"]
            args += ["--input-len", str(LOAD_INPUT_LEN), "--range-ratio", str(LOAD_RANGE_RATIO), "--seed", str(SEED)]
            client = asyncio.create_task(run_loadgen(url, tag, args, workdir / f"{tag}-load.json"))
            try:
                result = await run_training(settings, url, out=out, progress=False, quiet=True, dispatcher=True)
                await client
                first = await seen
            finally:
                for task in (client, seen):
                    task.cancel()
                await asyncio.gather(client, seen, return_exceptions=True)
        finally:
            await stop_all([door])
    r = Redis.from_url(url)
    try:
        spans = await runstats.run_spans(r, tag)
    finally:
        await r.aclose()
    return Live(result, spans, first)


def simulate(spec: ClusterSpec, live: Live, *, rate: float, load_s: float) -> tuple[float, list[runstats.Span]]:
    """The case simulated: (steady iteration s, spans). With BubbleTea on, the live load's requests
    arrive at the same moments relative to the steady window's start as they did live."""
    setup = build(spec)
    iterations = len(live.train.iteration_s)
    off = run_off(setup, iterations)
    if not spec.bubbletea.enabled:
        return off.iteration_s, off.spans
    assert live.first_request is not None, "the live run got no request"
    shift = runstats.steady_window(off.spans)[0] - runstats.steady_window(live.spans)[0]
    start = live.first_request + shift
    arrivals: Iterator[tuple[float, int]] = ((start + t, n) for t, n in load_plan(rate, load_s))
    on = run_on(setup, iterations, off.priors, arrivals)
    return on.iteration_s, on.spans


def figures(iteration_s: float, spans: list[runstats.Span], bubbletea: bool) -> dict[str, float | None]:
    u = runstats.utilization(spans)
    fill = u.fill_ratio if bubbletea else None
    return {"iteration": iteration_s * 1000, "bubble_fraction": u.bubble, "fill_ratio": fill}


async def run_case(case: Case, url: str, workdir: Path, *, iterations: int | None, rate: float) -> dict[str, Any]:
    raw = case_spec(case, iterations)
    path = workdir / f"{case.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_spec(path)
    predicted = run_off(build(spec), spec.training.iteration_limit or 2)
    load_s = 1.3 * sum(predicted.iteration_times) + 2.0  # from the first bubble to past training's end
    t0 = time.perf_counter()
    live = await run_live(raw, url, workdir, rate=rate, load_s=load_s)
    wall = time.perf_counter() - t0
    sim_iter, sim_spans = simulate(spec, live, rate=rate, load_s=load_s)
    got_live = figures(live.train.steady_iteration_s(), live.spans, case.bubbletea)
    got_sim = figures(sim_iter, sim_spans, case.bubbletea)
    row: dict[str, Any] = {"case": case.name, "iterations": len(live.train.iteration_s)}
    for f in FIGURES:
        a, b = got_live[f], got_sim[f]
        row[f"{f}_live"], row[f"{f}_sim"] = _r(a), _r(b)
        row[f"{f}_rel_err"] = None if a is None or b is None or a == 0 else round(abs(b - a) / abs(a), 4)
    row.update(lag_ms=round(live.train.lag_ms, 1), prefill_lag_ms=round(live.train.prefill_lag_ms, 1))
    # What limits agreement: the share of live worker time compute ran behind the profile (which the
    # simulator cannot know), and when the live load began, from the steady window's start (s).
    slots = spec.parallelism.pp * spec.parallelism.dp
    row["lag_share"] = round(live.train.lag_ms / 1000 / (slots * sum(live.train.iteration_s)), 4)
    if live.first_request is not None:
        row["load_from_s"] = round(live.first_request - runstats.steady_window(live.spans)[0], 3)
    row["live_s"] = round(wall, 1)
    print(_line(row), file=sys.stderr, flush=True)
    return row


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _line(r: dict[str, Any]) -> str:
    def cell(f: str) -> str:
        if r[f"{f}_live"] is None:
            return " " * 28
        scale = 1.0 if f == "iteration" else 100.0
        return f"{r[f'{f}_live'] * scale:8.2f} {r[f'{f}_sim'] * scale:8.2f} {r[f'{f}_rel_err'] * 100:5.1f}%  "

    return f"| {r['case']:<24} | " + " | ".join(cell(f) for f in FIGURES) + f" | {r['lag_ms']:8.1f} |"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in FIGURES:
        errs = [r[f"{f}_rel_err"] for r in rows if r.get(f"{f}_rel_err") is not None]
        out[f"{f}_rel_err"] = max(errs) if errs else None
    out["max_rel_err"] = max((v for v in out.values() if v is not None), default=None)
    out["cases"] = {r["case"]: {k: v for k, v in r.items() if k != "case"} for r in rows}
    return out


def cases_for(args: argparse.Namespace) -> list[Case]:
    specs = [Path(args.config)] if args.config else list(SPECS)
    if args.quick:  # each spec once off and once on; fair for the first, its own sharing for the rest
        out = []
        for i, s in enumerate(specs):
            sharing = "fair" if i == 0 else load_spec(s).wan.sharing
            out += [Case(s, sharing, False), Case(s, sharing, True)]
        return out
    return [Case(s, sh, bt) for s in specs for sh in SHARINGS for bt in (False, True)]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    cases = cases_for(args)
    iterations = args.iterations or (6 if args.quick else None)
    header = " | ".join(f"{f + ' live/sim/err':<28}" for f in FIGURES)
    print(f"| {'case':<24} | {header} | {'lag ms':>8} |", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis() as server:
            for case in cases:
                try:
                    rows.append(
                        await run_case(case, server.url, Path(tmp), iterations=iterations, rate=args.request_rate)
                    )
                except RuntimeError as exc:  # e.g. the load generator gave up: no live figures to compare
                    print(f"| {case.name:<24} | failed live: {exc}", file=sys.stderr, flush=True)
                    rows.append({"case": case.name, "error": str(exc)})
    return summary(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="one spec (with a device profile) instead of demo and wan-bound")
    ap.add_argument("--quick", action="store_true", help="6 iterations a run, each spec once off and once on")
    ap.add_argument("--iterations", type=int, help="training iterations per run (default: the spec's; 6 quick)")
    ap.add_argument("--request-rate", type=float, default=LOAD_RATE_PER_S, help="requests/s with BubbleTea on")
    args = ap.parse_args(argv)
    if args.config and load_spec(args.config).device.fwd_ms_per_layer is None:
        ap.error("--config: the spec needs a device profile (device.fwd_ms_per_layer), or live compute is unknown")
    out = uvloop.run(main_async(args))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
