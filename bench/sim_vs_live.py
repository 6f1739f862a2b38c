"""The simulator against the live system: the same specs run live and simulated, figure by figure.

Each case is one spec with one WAN sharing policy, BubbleTea off or on. Live, it is a real
training run (`bubbletea.launcher.train.run_training`: the broker and PP x DP stage workers as
processes on a private redis-server; with BubbleTea on also the front door, the dispatcher and the
load generator, as `bubbletea demo` runs them). Simulated, it is `sim.run.run_off` / `run_on` on
the very same spec. With BubbleTea on both get the same load: the load generator's Poisson arrivals
at the demo's rate (`--request-rate`) with prompts of 96 tokens +-50% (fewer where the spec's front
door accepts less), and the simulator replays exactly the requests the live front door accepted,
read off its request stream as they were queued (submission time and prompt length), at the same
moments relative to the steady window.

Both sides run on the device time scale (`shared.config.timescale`: measured here per case unless
`--time-scale K`): the live services get it from the environment, the simulator runs the scaled
spec, the load's rate is per emulated second, and iteration times are reported in emulated ms.

Every figure comes from `shared.figures.runstats` on each side's spans (steady iteration time as
`bubbletea train` reports it); per case and overall the relative error |sim - live| / live of the
iteration time, the bubble fraction and (BubbleTea on) the fill ratio.

    python bench/sim_vs_live.py                    # demo and wan-bound, fair and temporal, off and on
    python bench/sim_vs_live.py --quick            # fewer iterations and cases (a few minutes)
    python bench/sim_vs_live.py --config FILE      # any spec (with a device profile), fair and temporal
    python bench/sim_vs_live.py --prefill-scale 3  # a prefill profile 3x slower, one a small machine keeps
    python bench/sim_vs_live.py --generated 4      # 4 drawn specs (3-4 DCs, uneven links, both
                                                   # schedules; bench/lib/drawn_specs.py), BubbleTea off

Beside the live and simulated iteration time, each case has the analytic model's
(`iteration_model`, `iteration_model_rel_err` against live; `iteration_sim_model_rel_err` between
the simulator and the model): the one engine with no bus hops, on the same scaled spec.

With BubbleTea on, each side's overrun too (`overrun_share_live` / `_sim`: training's wait past its
input in filled bubbles, a share of the workers' steady time), compared as a difference in points
(`overrun_share_abs_err`): with the fit rule it is near 0 on both sides, where a ratio means nothing.

Prints a table, then one JSON line last (keys ending in `_rel_err`, `max_rel_err`; per case
`lag_ms`: how far live training compute fell behind the device profile, summed over workers and
iterations; `prefill_lag_share`: the share of live prefill time that was prefill running behind its
profile, which the simulator cannot know and which inflates the live fill ratio by about as much).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
import yaml

from bubbletea.launcher.demo import LOAD_INPUT_LEN, LOAD_RANGE_RATIO
from bubbletea.launcher.load import run_loadgen
from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import TrainResult, run_training
from bubbletea.progress import StepBar, say
from loadgen.datasets import length_range
from shared.config.deprecated import spec_builtins
from shared.config.settings import load_settings
from shared.config.spec import ClusterSpec, load_spec
from shared.config.timescale import scale_spec
from shared.figures import runstats
from shared.figures.training import lag_share, steady_iteration_s
from shared.model.calibration import calibrate
from shared.policies.pipeline_run import simulate as analytic
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import FIELD, PrefillRequest, decode, keys
from sim.run import run_off, run_on
from sim.setup import BUS_S, DEFAULT_PREFILL, build

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.drawn_specs import generated  # noqa: E402
from bench.lib.sim_compare import FIGURES, figures, line, overrun_share, r4, rel, summary  # noqa: E402
from bench.lib.sim_fit import fit_bus_s  # noqa: E402
from shared.bus.connection import client_for  # noqa: E402

SPECS = (ROOT / "configs" / "demo.yaml", ROOT / "configs" / "wan-bound.yaml")
SHARINGS = ("fair", "temporal")
#: A live request still queued when training ends fails at its deadline; the load generator waits
#: for it. 5 s keeps each run's tail short (the figures are over the training window only).
REQUEST_TIMEOUT_S = 5
SEED = 0
#: How long one read of the request stream blocks (the watcher is cancelled when the run ends).
WATCH_BLOCK_MS = 1000


@dataclass(frozen=True)
class Case:
    spec: Path
    sharing: str
    bubbletea: bool

    @property
    def name(self) -> str:
        return f"{self.spec.stem}-{self.sharing}-{'on' if self.bubbletea else 'off'}"


def case_spec(case: Case, iterations: int | None, prefill_scale: float = 1.0) -> dict[str, Any]:
    """The spec of one case, as plain data (written to a file for the live services); its prefill
    profile times `prefill_scale`."""
    raw: dict[str, Any] = spec_builtins(load_spec(case.spec))
    raw["wan"]["sharing"] = case.sharing
    raw["bubbletea"]["enabled"] = case.bubbletea
    raw["prefill"]["request_timeout_s"] = REQUEST_TIMEOUT_S
    if iterations is not None:
        raw["training"]["iterations"] = iterations
    if raw["device"].get("prefill_ms_per_layer") is None:  # else live prefill counts for raw CPU time,
        # which the simulator cannot know: both sides get the profile the simulator assumes
        raw["device"]["prefill_ms_per_layer"] = round(DEFAULT_PREFILL.fixed_s * 1000, 6)
        raw["device"]["prefill_us_per_token"] = round(DEFAULT_PREFILL.per_token_s * 1e6, 6)
    for k in ("prefill_ms_per_layer", "prefill_us_per_token"):
        raw["device"][k] = round((raw["device"][k] or 0.0) * prefill_scale, 6)
    return raw


@dataclass
class Live:
    train: TrainResult
    spans: list[runstats.Span]
    #: the requests the front door accepted: (wall-clock submission time s, prompt tokens)
    requests: list[tuple[float, int]]


#: The live runs' load, requests per real second: a fixed rate (the one the demo offered before it
#: offered a share of its bubbles' capacity); the simulator replays the very requests the live run
#: received, so any rate compares like with like.
REQUEST_RATE_PER_S = 80.0


def load_input_len(max_prompt_tokens: int) -> int:
    """The load's mean prompt length: the demo's, or less, so that every drawn prompt fits what the
    spec's front door accepts (a longer one is refused with a 400 and never reaches a bubble)."""
    n = LOAD_INPUT_LEN
    while n > 1 and length_range(n, LOAD_RANGE_RATIO)[1] > max_prompt_tokens:
        n -= 1
    return n


async def watch_requests(url: str, stream: str, into: list[tuple[float, int]]) -> None:
    """Every request queued on `stream` from now on, appended to `into` as it comes (read before
    the dispatcher's consumer group trims it), until cancelled."""
    r = client_for(url, protocol=None, socket_timeout=None)
    try:
        # "From now on" is the newest entry's id, taken once: reading from "$" again after a block
        # that timed out would miss a request queued between the two reads.
        newest: Any = await r.xrevrange(stream, count=1)
        last = newest[0][0] if newest else "0-0"
        while True:
            reply: Any = await r.xread({stream: last}, block=WATCH_BLOCK_MS)
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last = entry_id
                    req = decode(fields[FIELD])
                    if isinstance(req, PrefillRequest):
                        into.append((req.submitted, len(req.tokens)))
    finally:
        await r.aclose()


async def run_live(
    spec: dict[str, Any], url: str, workdir: Path, *, rate: float, load_s: float, input_len: int
) -> Live:
    tag = f"svl-{spec['name']}-{random.randrange(1 << 30):x}"
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    settings = load_settings(path, env={"BUBBLETEA_RUN": tag})
    out = io.StringIO()
    requests: list[tuple[float, int]] = []
    if not spec["bubbletea"]["enabled"]:
        result = await run_training(settings, url, out=out, progress=False, quiet=True)
    else:
        env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_RUN": tag}  # the dispatcher's run
        async with front_door(env, out=out) as door:
            assert door.url is not None
            seen = asyncio.create_task(watch_requests(url, keys.prefill_requests_stream(tag), requests))
            args = ["--base-url", door.url, "--request-rate", f"{rate:g}", "--duration", f"{load_s:.2f}"]
            args += ["--input-len", str(input_len), "--range-ratio", str(LOAD_RANGE_RATIO), "--seed", str(SEED)]
            client = asyncio.create_task(run_loadgen(args, workdir / f"{tag}-load.json"))
            try:
                result = await run_training(settings, url, out=out, progress=False, quiet=True, dispatcher=True)
                await client
            finally:
                for task in (client, seen):
                    task.cancel()
                await asyncio.gather(client, seen, return_exceptions=True)
    r = client_for(url, protocol=None)
    try:
        spans = await runstats.run_spans(r, tag)
    finally:
        await r.aclose()
    requests.sort()
    return Live(result, spans, requests)


def simulate(spec: ClusterSpec, live: Live) -> tuple[float, list[runstats.Span], float]:
    """The case simulated: (steady iteration s, spans, the bus hop s). With BubbleTea on, the
    requests the live front door accepted arrive at the same moments relative to the steady window's
    start as live. The bus hop is the live run's (`sim_fit.fit_bus_s`), the one figure taken from
    it: the host's latency, which the time scale does not stretch."""
    setup = build(spec)
    bus_s = fit_bus_s(setup.pipeline.stage_dc, live.spans) or BUS_S
    setup = build(spec, bus_s=bus_s)
    iterations = len(live.train.iteration_s)
    off = run_off(setup, iterations)
    if not spec.bubbletea.enabled:
        return off.iteration_s, off.spans, bus_s
    if not live.requests:
        raise RuntimeError("the live run accepted no request")
    shift = runstats.steady_window(off.spans)[0] - runstats.steady_window(live.spans)[0]
    on = run_on(setup, iterations, off.priors, iter([(t + shift, n) for t, n in live.requests]))
    return on.iteration_s, on.spans, bus_s


async def run_case(
    case: Case,
    url: str,
    workdir: Path,
    *,
    iterations: int | None,
    rate: float,
    prefill_scale: float,
    time_scale: float | None = None,
) -> dict[str, Any]:
    raw = case_spec(case, iterations, prefill_scale)
    path = workdir / f"{case.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    # The live services run the spec on the device time scale (this machine measured, unless
    # --time-scale K); the simulator runs the same scaled spec, so both sides share one clock, and
    # the load's rate is per emulated second. Times are reported in emulated ms (real / k).
    k = time_scale if time_scale is not None else (await asyncio.to_thread(calibrate, load_spec(path))).scale
    os.environ["BUBBLETEA_TIME_SCALE"] = f"{k:g}"  # the live services inherit it
    spec = scale_spec(load_spec(path), k)
    rate /= k
    setup = build(spec)
    predicted = run_off(setup, spec.training.iteration_limit or 2)
    load_s = 1.3 * sum(predicted.iteration_times) + 2.0  # from the first bubble to past training's end
    t0 = time.perf_counter()
    input_len = load_input_len(setup.max_prompt_tokens)
    live = await run_live(raw, url, workdir, rate=rate, load_s=load_s, input_len=input_len)
    wall = time.perf_counter() - t0
    sim_iter, sim_spans, bus_s = simulate(spec, live)
    got_live = figures(live.train.steady_iteration_s() / k, live.spans, case.bubbletea)
    got_sim = figures(sim_iter / k, sim_spans, case.bubbletea)
    row: dict[str, Any] = {"case": case.name, "iterations": len(live.train.iteration_s), "device_time_scale": k}
    row["bus_ms"] = round(bus_s * 1000, 3)  # real ms: the live run's hop, which the simulator took
    for f in FIGURES:
        a, b = got_live[f], got_sim[f]
        row[f"{f}_live"], row[f"{f}_sim"] = r4(a), r4(b)
        row[f"{f}_rel_err"] = rel(b, a)
    # the analytic model: the same engine with no bus hops, on the same scaled spec
    model_ms = steady_iteration_s(analytic(setup.pipeline, len(live.train.iteration_s)).iteration_times) * 1000 / k
    if case.bubbletea:  # both on the same scaled clock: a share needs no k
        a, b = overrun_share(live.spans), overrun_share(sim_spans)
        row.update(overrun_share_live=r4(a), overrun_share_sim=r4(b), overrun_share_abs_err=r4(abs(b - a)))
    row["iteration_model"] = r4(model_ms)
    row["iteration_model_rel_err"] = rel(model_ms, got_live["iteration"])
    row["iteration_sim_model_rel_err"] = rel(got_sim["iteration"], model_ms)
    row.update(lag_ms=round(live.train.lag_ms, 1), prefill_lag_ms=round(live.train.prefill_lag_ms, 1))
    # What limits agreement: the share of live worker time training compute ran behind the profile,
    # the share of live prefill time that was prefill running behind its profile (neither of which
    # the simulator can know), and when the live load began, from the steady window's start (s).
    slots = spec.parallelism.pp * spec.parallelism.dp
    row["lag_share"] = round(lag_share(live.train.lag_ms, slots, live.train.iteration_s), 4)
    if any(s.kind == "prefill" for s in live.spans):
        row["prefill_lag_share"] = round(runstats.prefill_lag_share(live.train.prefill_lag_ms, live.spans), 4)
    if live.requests:
        row["load_from_s"] = round(live.requests[0][0] - runstats.steady_window(live.spans)[0], 3)
        row["requests"], row["input_len"] = len(live.requests), input_len
    row["live_s"] = round(wall, 1)
    say(line(row), sys.stderr)
    return row


def cases_for(args: argparse.Namespace, workdir: Path) -> list[Case]:
    if args.generated:  # drawn specs, written where the live services read them; BubbleTea off
        out = []
        for raw in generated(args.generated, args.seed):
            path = workdir / f"{raw['name']}.yaml"
            path.write_text(yaml.safe_dump(raw))
            out.append(Case(path, raw["wan"]["sharing"], False))
        return out
    specs = [Path(args.config)] if args.config else list(SPECS)
    if args.quick:  # each spec once off and once on; fair for the first, its own sharing for the rest
        out = []
        for i, s in enumerate(specs):
            sharing = "fair" if i == 0 else load_spec(s).wan.sharing
            out += [Case(s, sharing, False), Case(s, sharing, True)]
        return out
    return [Case(s, sh, bt) for s in specs for sh in SHARINGS for bt in (False, True)]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    iterations = args.iterations or (6 if args.quick else None)
    header = " | ".join(f"{f + ' live/sim/err':<28}" for f in FIGURES)
    print(f"| {'case':<24} | {header} | {'model/err':<14} | {'lag ms':>8} | {'prefill lag':>8} |", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "generated").mkdir()
        cases = cases_for(args, Path(tmp) / "generated")
        async with EmbeddedRedis() as server, StepBar(len(cases), "cases", sys.stderr) as bar:
            for case in cases:
                try:
                    rows.append(
                        await run_case(
                            case,
                            server.url,
                            Path(tmp),
                            iterations=iterations,
                            rate=args.request_rate,
                            prefill_scale=args.prefill_scale,
                            time_scale=None if args.time_scale == "auto" else float(args.time_scale),
                        )
                    )
                except RuntimeError as exc:  # e.g. the load generator gave up: no live figures to compare
                    say(f"| {case.name:<24} | failed live: {exc}", sys.stderr)
                    rows.append({"case": case.name, "error": str(exc)})
                bar.advance()
    return summary(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="one spec (with a device profile) instead of demo and wan-bound")
    ap.add_argument("--quick", action="store_true", help="6 iterations a run, each spec once off and once on")
    ap.add_argument("--iterations", type=int, help="training iterations per run (default: the spec's; 6 quick)")
    gen = "N drawn specs instead (3-4 datacenters, uneven links, both schedules; BubbleTea off)"
    ap.add_argument("--generated", type=int, default=0, metavar="N", help=gen)
    ap.add_argument("--seed", type=int, default=SEED, help="the draw of --generated (default 0)")
    ap.add_argument(
        "--request-rate", type=float, default=REQUEST_RATE_PER_S, help="requests/s with BubbleTea on (default 80)"
    )
    ap.add_argument(
        "--prefill-scale",
        type=float,
        default=1.0,
        help="multiply the specs' prefill profile (a device the live machine can keep up with; default 1)",
    )
    ap.add_argument(
        "--time-scale",
        default="auto",
        metavar="K",
        help="the device time scale of every case (shared/config/timescale.py): auto (the default) measures this "
        "machine for each case's spec; or a number >= 1 (1: the profile as written)",
    )
    args = ap.parse_args(argv)
    if not args.prefill_scale > 0:
        ap.error(f"--prefill-scale must be > 0, got {args.prefill_scale}")
    if args.config and load_spec(args.config).device.fwd_ms_per_layer is None:
        ap.error("--config: the spec needs a device profile (device.fwd_ms_per_layer), or live compute is unknown")
    out = uvloop.run(main_async(args))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
