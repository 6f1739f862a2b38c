"""The simulator against a live run on real compute (`bench/bubble_fill.py --sim`; the GPU check
passes it): the device's times are *learned* from the live pair, then its spec is simulated with
them, figure by figure.

A run with no device profile has no times for the simulator to take. This module fits them from
what the live pair recorded:

* training, from the off run's spans: each stage's forward and backward (its median span, with
  its embedding or head), the optimizer step (median), the all-reduce (its 10th percentile: a span
  also holds the wait for a slower peer, which the simulator adds by itself);
* prefill, from the on run's batch reports (every fresh request answered, its seconds over its
  layers, against its prompt tokens): a block's fixed part and its part per token, by least squares,
  where a block is a piece of `piece_tokens` tokens when the live worker ran pieces. The launch
  floor and the first token's read are left at 0: a fitted fixed part holds the host's launch time
  already, and a live worker reads the first token off the prefill thread (`finish_async`).

The fitted profile goes into the spec's `device` section; the simulator then runs it off, and on
with the very requests the live front door accepted (submission time, prompt length), at the same
moments relative to the steady window. Relative errors of the steady iteration time, the bubble
fraction (off) and the fill ratio (on) come out as `sim_*` keys.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
from dataclasses import replace
from typing import Any

import numpy as np

from shared.bus.connection import client_for
from shared.config.spec import ClusterSpec, parse_spec
from shared.figures import runstats
from shared.model.shape import model_info
from shared.policies.fill import piece_tokens
from shared.policies.pipeline_plan import layers_per_stage
from shared.policies.spans import Span
from shared.wire import FIELD, PrefillReport, PrefillRequest, decode, keys
from shared.wire.status import ItemOutcome
from sim.run import run_off, run_on
from sim.setup import build

#: How long a watcher blocks on a read (ms): it is cancelled when the run ends.
WATCH_BLOCK_MS = 200


async def watch(url: str, streams: list[str], into: list[Any]) -> None:
    """Every message queued on `streams` from now on, appended to `into` as it comes (read before
    the consumer groups' trimming drops it), until cancelled."""
    r = client_for(url, protocol=None, socket_timeout=None)
    try:
        last: dict[Any, Any] = {}
        for s in streams:  # "from now on": each stream's newest id, taken once
            newest: Any = await r.xrevrange(s, count=1)
            last[s] = newest[0][0] if newest else "0-0"
        while True:
            reply: Any = await r.xread(last, block=WATCH_BLOCK_MS)
            for stream, entries in reply or ():
                for entry_id, fields in entries:
                    last[stream.decode() if isinstance(stream, bytes) else stream] = entry_id
                    into.append(decode(fields[FIELD]))
    finally:
        await r.aclose()


def record(url: str, run: str, into: list[Any]) -> asyncio.Task[None]:
    """A watcher of the requests the front door accepts and the run's batch reports."""
    return asyncio.create_task(watch(url, [keys.prefill_requests_stream(run), keys.prefill_reports_stream(run)], into))


def fit_training(spec: ClusterSpec, spans: list[Span]) -> dict[str, float]:
    """The device section's training times (ms), from a run's spans (see the module docstring)."""
    layers = layers_per_stage(spec)
    per_layer = {
        kind: statistics.median((s.end - s.start) * 1000 / layers[s.stage] for s in spans if s.kind == kind)
        for kind in ("fwd", "bwd")
    }
    out = {"fwd_ms_per_layer": per_layer["fwd"], "bwd_ms_per_layer": per_layer["bwd"]}
    steps = [(s.end - s.start) * 1000 for s in spans if s.kind == "step"]
    reduces = sorted((s.end - s.start) * 1000 for s in spans if s.kind == "allreduce")
    out["step_ms"] = statistics.median(steps) if steps else 0.0
    out["allreduce_ms"] = reduces[len(reduces) // 10] if reduces else 0.0
    return out


def fit_bus_s(stage_dc: tuple[str, ...] | list[str], spans: list[Span]) -> float | None:
    """The bus hop of a live run (s): the median, over the tensors a waiting stage received from a
    stage in its own datacenter, of their arrival (the wait's `input_at`) less their sender's
    compute span's end (the send follows it at once). What the host adds to every hop (the
    outbox, Redis or the socket, the receiver's wake-up), which the time scale does not stretch:
    at k = 1 it is milliseconds on a pipeline of stages a few milliseconds long, and a simulator
    with a fixed 0.3 ms hop missed the bubbles by 11% (issue 63). None: no such tensor waited for."""
    compute = {(s.replica, s.stage, s.iteration, s.kind, s.microbatch): s for s in spans if s.kind in ("fwd", "bwd")}
    by_worker: dict[tuple[int, int], list[Span]] = {}
    for s in spans:
        by_worker.setdefault((s.replica, s.stage), []).append(s)
    hops = []
    for (replica, stage), mine in by_worker.items():
        mine.sort(key=lambda s: s.start)
        for wait, after in itertools.pairwise(mine):
            if wait.kind != "wait" or wait.input_at is None or after.kind not in ("fwd", "bwd"):
                continue
            peer = stage - 1 if after.kind == "fwd" else stage + 1  # who sent what it waited for
            sent = compute.get((replica, peer, after.iteration, after.kind, after.microbatch))
            if sent is not None and 0 <= peer < len(stage_dc) and stage_dc[peer] == stage_dc[stage]:
                hops.append(wait.input_at - sent.end)
    return statistics.median(hops) if hops else None


def stage_seconds(spec: ClusterSpec, spans: list[Span], kind: str) -> tuple[float, ...]:
    """Each stage's median `kind` span (s): a stage's own, with its embedding or head, which a time
    per layer cannot say (the head of a 32k vocabulary costs a Llama stage a few layers' worth)."""
    return tuple(
        statistics.median(s.end - s.start for s in spans if s.kind == kind and s.stage == k)
        for k in range(spec.parallelism.pp)
    )


def fit_prefill(recorded: list[Any], layers: int, piece_tokens: int | None) -> dict[str, float] | None:
    """`prefill_ms_per_layer` (a block's fixed part) and `prefill_us_per_token`, from the reports of
    fresh requests run whole (None with fewer than two prompt lengths to fit)."""
    tokens = {m.id: len(m.tokens) for m in recorded if isinstance(m, PrefillRequest)}
    seen: set[str] = set()
    rows: list[tuple[float, float]] = []
    secs: list[float] = []
    for m in recorded:
        if not isinstance(m, PrefillReport):
            continue
        for p in m.progress:
            first = p.id not in seen
            seen.add(p.id)
            n = tokens.get(p.id)
            if first and n and p.outcome is ItemOutcome.DONE and p.started_layer == -1 and p.seconds > 0:
                pieces = 1 if piece_tokens is None else -(-n // piece_tokens)
                rows.append((float(pieces), float(n)))
                secs.append(p.seconds / layers)
    if len({n for _, n in rows}) < 2:
        return None
    (fixed, per_token), *_ = np.linalg.lstsq(np.array(rows), np.array(secs), rcond=None)
    fixed_ms, per_token_us = max(float(fixed), 0.0) * 1000, max(float(per_token), 0.0) * 1e6
    return {"prefill_ms_per_layer": fixed_ms, "prefill_us_per_token": per_token_us}


def compare(
    spec: dict[str, Any],
    *,
    iterations: int,
    iteration_s: tuple[float, float],
    spans_off: list[Span],
    spans_on: list[Span],
    recorded: list[Any],
    piece_tokens: int | None,
) -> dict[str, Any]:
    """The live pair (its steady `iteration_s` off and on, its spans, what it `recorded`) against
    the simulator on its spec with the fitted device times: `sim_*` keys."""
    live_spec = parse_spec(spec)
    prefill_layers = model_info(live_spec.prefill).layers
    fitted = fit_training(live_spec, spans_off)
    prefill = fit_prefill(recorded, prefill_layers, piece_tokens)
    if prefill is None:
        return {"sim_fitted": fitted, "sim_why": "too few answered requests of different lengths to fit prefill"}
    fitted |= prefill
    device = {**spec.get("device", {}), **fitted}
    bubbletea = {**spec["bubbletea"], "piece_tokens": piece_tokens or 0}
    sim_spec = parse_spec({**spec, "device": device, "bubbletea": bubbletea})
    setup = build(sim_spec)
    fwd, bwd = (stage_seconds(live_spec, spans_off, kind) for kind in ("fwd", "bwd"))
    setup = replace(setup, pipeline=replace(setup.pipeline, fwd_s=fwd, bwd_s=bwd))
    off = run_off(setup, iterations)
    requests = sorted((m.submitted, len(m.tokens)) for m in recorded if isinstance(m, PrefillRequest))
    shift = runstats.steady_window(off.spans)[0] - runstats.steady_window(spans_on)[0]
    on = run_on(setup, iterations, off.priors, iter([(t + shift, n) for t, n in requests]))
    live_off, live_on = runstats.utilization(spans_off), runstats.utilization(spans_on)
    sim_off, sim_on = runstats.utilization(off.spans), runstats.utilization(on.spans)
    pairs = {
        "iteration_off_ms": (iteration_s[0] * 1000, off.iteration_s * 1000),
        "iteration_on_ms": (iteration_s[1] * 1000, on.iteration_s * 1000),
        "bubble_fraction": (live_off.bubble, sim_off.bubble),
        "fill_ratio": (live_on.fill_ratio, sim_on.fill_ratio),
    }
    out: dict[str, Any] = {"sim_fitted": {k: round(v, 4) for k, v in fitted.items()}}
    for name, (live, sim) in pairs.items():
        out[f"sim_{name}"] = {"live": round(live, 4), "sim": round(sim, 4), "rel_err": _rel(sim, live)}
    errs = [v["rel_err"] for k, v in out.items() if k != "sim_fitted" and v["rel_err"] is not None]
    out["sim_max_rel_err"] = max(errs) if errs else None
    return out


def compare_last(last: list[Any], iterations: int) -> dict[str, Any]:
    """`--sim`: the last pair against the simulator with the device times fitted from it (`sim_fit`)."""
    result_off, off_t, result_on, on_t = last
    spec = on_t["spec"]
    pieces = piece_tokens(spec["bubbletea"].get("piece_tokens", 0), on_gpu=workers_on_gpu(spec))
    return compare(
        spec,
        iterations=iterations,
        iteration_s=(result_off.steady_iteration_s(), result_on.steady_iteration_s()),
        spans_off=off_t["spans"],
        spans_on=on_t["spans"],
        recorded=on_t["recorded"],
        piece_tokens=pieces,
    )


def workers_on_gpu(spec: dict[str, Any]) -> bool:
    """Whether this spec's workers compute on a GPU here (`device.kind` auto or cuda, and CUDA seen)."""
    import torch

    return spec.get("device", {}).get("kind", "auto") != "cpu" and torch.cuda.is_available()


def _rel(value: float, reference: float) -> float | None:
    return None if reference == 0 else round(abs(value - reference) / abs(reference), 4)
