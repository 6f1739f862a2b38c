"""`bubbletea demo`: the main job. Three training runs of the same spec, side by side.

1. **fair**: the WAN links shared fairly, one TCP connection per transfer, BubbleTea off
   (what a plain pipeline over a WAN gets);
2. **atlas**: Atlas's temporal sharing with several connections per transfer, BubbleTea off;
3. **bubbletea**: Atlas plus BubbleTea, with the load generator sending prefill requests over
   HTTP for the whole run, at 80% of what run 2's bubbles could hold (`capacity.offer`): they are
   answered with first tokens computed in the bubbles.

Everything runs as real processes on one Redis (embedded unless REDIS_URL is set): the front
door for the whole demo; per run the WAN broker, one stage worker per slot and (run 3) the
dispatcher. It prints a comparison table and writes a run folder (``runs/demo-<time>/``) with
summary.json, each run's spans, the TTFTs, the table and the pictures (see docs/report.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from bubbletea.launcher.load import run_loadgen
from bubbletea.launcher.procs import Proc, open_redis, spawn, stop_all, wait_http_healthy
from bubbletea.launcher.services import PREFILL_QUEUE
from bubbletea.launcher.timescale import pick_time_scale
from bubbletea.launcher.train import TrainResult, run_training
from shared.bus import Bus
from shared.config.deprecated import spec_builtins
from shared.config.settings import Settings, load_settings
from shared.config.spec import ClusterSpec
from shared.control.health import wait_live
from shared.figures import runstats
from shared.figures.bubblestats import bubble_dispatch, run_control
from shared.figures.capacity import DEFAULT_SHARE, offer, prefill_block_s
from shared.figures.percentiles import percentile
from shared.figures.requests import requests_lost, slo_attainment, ttft_ms
from shared.figures.training import slowdown_pct, speedup
from shared.model.shape import model_info
from shared.runtime.logs import get_logger
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis, free_port
from shared.wire import ControlSeen

log = get_logger(__name__)

#: The load during the BubbleTea run: Poisson arrivals of random prompts of 48-144 tokens at
#: `capacity.DEFAULT_SHARE` (80%) of what the Atlas run's bubbles could hold (`capacity.offer`), as
#: bench/bubble_fill.py offers it.
LOAD_INPUT_LEN = 96
LOAD_RANGE_RATIO = 0.5
#: The TTFT objective the table's attainment is taken against (device ms): every request sent counts.
TTFT_SLO_DEVICE_MS = 1000.0


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    label: str
    sharing: str
    connections: int | None  # None: as in the spec
    bubbletea: bool


PHASES = (
    Phase("fair", "Fair sharing, 1 connection, BubbleTea off", "fair", 1, False),
    Phase("atlas", "Atlas (temporal sharing, several connections), BubbleTea off", "temporal", None, False),
    Phase("bubbletea", "Atlas + BubbleTea, prefill load over HTTP", "temporal", None, True),
)


def phase_spec(spec: ClusterSpec, phase: Phase) -> dict[str, Any]:
    raw: dict[str, Any] = spec_builtins(spec)
    raw["wan"]["sharing"] = phase.sharing
    if phase.connections is not None:
        raw["wan"]["default"]["connections"] = phase.connections
        for link in raw["wan"]["links"]:
            link["connections"] = phase.connections
    raw["bubbletea"]["enabled"] = phase.bubbletea
    return raw


async def run_demo(settings: Settings, *, hold: bool = False, out_root: Path | None = None) -> int:
    embedded: EmbeddedRedis | EmbeddedCluster | None = None
    procs: list[Proc] = []
    folder = (out_root or Path("runs")) / time.strftime("demo-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.getpid()}-{int(time.time())}"  # each phase is a run of its own: `phase_run`
    try:
        url, embedded, where = open_redis(settings.redis_url)
        say(f"==> {where}")
        scale = await pick_time_scale(settings, say)
        port = free_port()
        env = {
            "REDIS_URL": url,
            "BUBBLETEA_CONFIG": str(settings.spec_path),
            "BUBBLETEA_LOG_LEVEL": settings.log_level,
            "BUBBLETEA_HTTP_HOST": "127.0.0.1",
            "BUBBLETEA_HTTP_PORT": str(port),
            # the front door queues for the run that serves (the others take no load)
            "BUBBLETEA_RUN": next(phase_run(p, stamp) for p in PHASES if p.bubbletea),
        }
        door = await spawn(PREFILL_QUEUE, env, quiet=True)
        procs.append(door)
        api = f"http://127.0.0.1:{port}"
        await wait_http_healthy(door, api)
        async with Bus(url, settings.spec.bus, name="demo") as bus:
            await wait_live(bus.redis, PREFILL_QUEUE.name, timeout_s=10)
        say(f"==> prefill_queue is healthy at {api} (pid={door.proc.pid}); run folder: {folder}")
        rows = []
        atlas_wall, rate = 0.0, 0.0
        for i, phase in enumerate(PHASES, 1):
            say("")
            say(f"==> [{i}/{len(PHASES)}] {phase.label}")
            row, wall, spans = await _run_phase(
                settings, phase, phase_run(phase, stamp), url, api, folder, load_s=atlas_wall, scale=scale, rate=rate
            )
            if phase.name == "atlas":  # the load runs for about as long as that run trained, at 80% of
                atlas_wall = wall  # what its bubbles could hold
                rate = await asyncio.to_thread(_offered_rate, settings, spans, scale)
            rows.append(row)
        _finish_summary(rows)
        (folder / "summary.json").write_text(
            json.dumps(
                {
                    "spec": str(settings.spec_path),
                    "device_time_scale": scale,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "runs": rows,
                },
                indent=2,
            )
        )
        _report(folder, scale)
        if hold:
            say(f"==> the front door stays up at {api}; press Ctrl-C to stop")
            await _until_a_service_dies(procs)
            return 1
        return 0
    finally:
        codes = await stop_all(procs)
        for name, code in codes.items():
            if code not in (0, None):
                say(f"==> {name} exited with code {code}")
        if embedded is not None:
            embedded.stop()
        say("==> stopped cleanly" if all(c == 0 for c in codes.values()) else "==> stopped (with errors)")


def _offered_rate(settings: Settings, spans: list[runstats.Span], scale: float) -> float:
    """Requests per real second at `DEFAULT_SHARE` of the bubbles' capacity in the run `spans`."""
    base = settings.base_spec or settings.spec
    cost = prefill_block_s(base, scale, LOAD_INPUT_LEN)
    offered = offer(spans, cost, model_info(base.prefill).layers, LOAD_INPUT_LEN, DEFAULT_SHARE)
    say(f"    {offered.line(DEFAULT_SHARE, scale)}")
    return offered.rate_per_s


def phase_run(phase: Phase, stamp: str) -> str:
    """The run id of `phase` in the demo started at `stamp`."""
    return f"demo-{phase.name}-{stamp}"


async def _run_phase(
    settings: Settings,
    phase: Phase,
    run: str,
    url: str,
    api: str,
    folder: Path,
    *,
    load_s: float,
    scale: float,
    rate: float,
) -> tuple[dict[str, Any], float, list[runstats.Span]]:
    spec_path = folder / phase.name / "spec.yaml"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    base = settings.base_spec or settings.spec  # unscaled: the services apply the time scale
    spec_path.write_text(yaml.safe_dump(phase_spec(base, phase), sort_keys=False))
    phase_settings = load_settings(
        spec_path, env={"BUBBLETEA_RUN": run, "REDIS_URL": url, "BUBBLETEA_TIME_SCALE": f"{scale:g}"}
    )
    load: asyncio.Task[dict[str, Any]] | None = None
    if phase.bubbletea:
        load = asyncio.create_task(_load(api, max(1.0, load_s), folder / phase.name, max(rate, 0.1)))
    # The BubbleTea run trains on until the load is done: a load generator that got going late (a
    # busy machine, a short spec) still has bubbles to be served in, never a run that has ended.
    result = await run_training(
        phase_settings, url, progress=True, quiet=True, dispatcher=phase.bubbletea, until=load, label=phase.name
    )
    wall = sum(result.iteration_s) * 0.8  # most of the training time (start-up left out)
    loadgen = await load if load is not None else None
    async with Bus(url, settings.spec.bus, name="demo") as bus:
        spans = await runstats.run_spans(bus.redis, run)
        seen = await run_control(bus.redis, run)
    runstats.write_spans(folder / phase.name / "spans.jsonl", spans)
    ttfts: list[float] = loadgen["ttfts_ms"] if loadgen else []
    (folder / phase.name / "ttft_ms.json").write_text(json.dumps(ttfts))
    m = _metrics(result, spans, loadgen, scale, seen)
    row = {"name": phase.name, "label": phase.label, "metrics": m}
    say(
        f"    iteration {m['iteration_ms']:.1f} ms, bubble fraction {m['bubble_fraction']:.1%}, "
        f"utilization {m['utilization']:.1%}, compute behind the profile: training {m['training_lag_ms']:.0f} ms, "
        f"prefill {m['prefill_lag_pct']:.2f}% of its time"
        + (
            f", {m['requests_answered']} of {m['requests_sent']} prefill requests answered, TTFT p50 "
            f"{m['ttft_p50_ms']:.0f} device ms, {m['slo_attainment']:.1%} of those sent within "
            f"{TTFT_SLO_DEVICE_MS:g}; {m['bubbles_with_work_filled']} of {m['bubbles_with_work']} bubbles with work "
            f"filled (a prefill ran in {m['bubbles_filled']} of all {m['bubbles_total']})"
            if loadgen and m["ttft_p50_ms"] is not None
            else ""
        )
    )
    return row, wall, spans


async def _load(api: str, duration_s: float, folder: Path, rate: float) -> dict[str, Any]:
    """The load generator from the moment the run serves, for `duration_s`: its JSON summary."""
    args = ["--base-url", api, "--request-rate", f"{rate:g}", "--duration", f"{duration_s:.1f}"]
    args += ["--input-len", str(LOAD_INPUT_LEN), "--range-ratio", str(LOAD_RANGE_RATIO), "--seed", "0"]
    return await run_loadgen(args, folder / "loadgen.json")


def _metrics(
    result: TrainResult,
    spans: list[runstats.Span],
    load: dict[str, Any] | None,
    scale: float = 1.0,
    seen: list[ControlSeen] | None = None,
) -> dict[str, Any]:
    """The row of one run. Times in emulated ms (real over the device time scale `scale`); every
    bubble and every request sent counts (`bubblestats`)."""
    u = runstats.utilization(spans)
    m: dict[str, Any] = {
        "iteration_ms": round(result.steady_iteration_s() * 1000 / scale, 1),
        "device_time_scale": scale,
        # how far real compute ran behind the profile it pads to (real ms; the prefill's as a share)
        "training_lag_ms": round(result.lag_ms, 1),
        "prefill_lag_pct": round(100 * runstats.prefill_lag_share(result.prefill_lag_ms, spans), 3),
        "bubble_fraction": round(u.bubble, 4),
        "utilization": round(u.busy, 4),
        "training_utilization": round(u.training, 4),
        "prefill_tokens_per_s": 0.0,
        "ttft_p50_ms": None,
        "ttft_p99_ms": None,
        "train_slowdown_pct": None,
        "requests_lost": None,
        "final_loss": round(result.losses[-1], 4),
        # how late the WAN broker delivered against its own policy (CPU contention shows here)
        "wan_late_p99_ms": round(max((v["late_p99_ms"] for v in result.links.values()), default=0.0), 2),
    }
    if load is not None:
        ttfts = load["ttfts_ms"]
        sent = load["completed"] + load["failed"]
        d = bubble_dispatch(spans, seen or [], scale)
        m.update(
            requests_sent=sent,
            slo_attainment=_round(slo_attainment(ttfts, sent, scale, TTFT_SLO_DEVICE_MS), 4),
            bubbles_total=d.total,
            bubbles_with_work=d.with_work,
            bubbles_filled=d.filled,
            bubbles_with_work_filled=len(d.filled_latencies_ms),
            dispatch_p99_ms=percentile(list(d.latencies_ms), 99),
        )
        m.update(
            prefill_tokens_per_s=round(load["input_throughput"] * scale, 1),  # per emulated second
            ttft_p50_ms=_round(ttft_ms(ttfts, 50, scale), 1),
            ttft_p99_ms=_round(ttft_ms(ttfts, 99, scale), 1),
            requests_answered=load["completed"],
            requests_failed=load["failed"],
            errors=load["error_counts"],
            bubble_fill_ratio=round(u.fill_ratio, 3),
            requests_lost=requests_lost(load["error_counts"]),
        )
    return m


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _finish_summary(rows: list[dict[str, Any]]) -> None:
    """Training slowdown of the BubbleTea run against the Atlas run (same spec, BubbleTea off)."""
    by = {r["name"]: r["metrics"] for r in rows}
    if "atlas" in by and "bubbletea" in by:
        base, on = by["atlas"]["iteration_ms"], by["bubbletea"]["iteration_ms"]
        by["bubbletea"]["train_slowdown_pct"] = round(slowdown_pct(on, base), 2)
        by["atlas"]["train_slowdown_pct"] = 0.0
    if "fair" in by and "atlas" in by:
        by["atlas"]["speedup_vs_fair"] = round(speedup(by["fair"]["iteration_ms"], by["atlas"]["iteration_ms"]), 3)


def _report(folder: Path, scale: float) -> None:
    from bubbletea.report import markdown_table, write_report
    from bubbletea.report.data import load_run_folder

    written = write_report(folder)
    say("")
    say(markdown_table(load_run_folder(folder).summary))
    say(
        f"(device time scale k = {scale:g}: times are device ms, real ms / k; TTFT <= 1 s and the fill count "
        "every request sent and every bubble)"
    )
    say("")
    say(f"==> report: {folder / 'report.md'} ({len(written)} files: tables and pictures)")
    for p in written:
        say(f"    {p}")
    if (folder / "dashboard.html").exists():
        say(f"==> the run's page (timeline, figures; zoom and hover): open {folder / 'dashboard.html'} in a browser")


async def _until_a_service_dies(procs: list[Proc]) -> None:
    """Block until Ctrl-C (cancellation) or until a service exits on its own (then say which)."""
    waits = {asyncio.create_task(p.proc.wait()): p for p in procs}
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in waits:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*waits, return_exceptions=True)
    for t in done:
        p = waits[t]
        say(f"==> {p.name} exited on its own with code {p.proc.returncode}; stopping the rest")
