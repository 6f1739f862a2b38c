"""`bubbletea simulate`: the command's work (bubbletea/cli.py only parses and calls `main`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import msgspec
from tqdm import tqdm

from loadgen.options import Renamed
from shared.config.env_values import objective_ms
from shared.config.settings import DEFAULT_SPEC
from shared.config.spec import ClusterSpec, ConfigError, load_spec
from shared.policies.placement import PlacementError
from sim.dispatchers import DispatchMode
from sim.output import figures, lines, write_folder
from sim.run import SimOptions, simulate
from sim.setup import BUS_S, DEFAULT_FWD_MS, SimError

#: Iterations when neither --iterations nor a finite training.iterations in the spec says.
DEFAULT_ITERATIONS = 10
#: The spec's training.iterations is used up to this many (a paper-scale spec asks for 100).
MAX_DEFAULT_ITERATIONS = 12
#: Without --request-rate the load is what the bubbles could hold, up to this many requests/s: a
#: paper-scale spec's bubbles could take ~13,000/s of the demo's tiny prompts, millions per run.
MAX_DEFAULT_RATE = 500.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    # as bubbletea.cli_common.add_spec_arguments (not imported: the simulator never imports the command)
    p.add_argument("spec", nargs="?", metavar="SPEC", help="cluster spec file (YAML; the same as --config)")
    p.add_argument("--config", help="cluster spec (default: $BUBBLETEA_CONFIG or configs/demo.yaml)")
    p.add_argument("--trace", metavar="CSV", type=Path, help="replay an Azure LLM inference trace (arrivals, lengths)")
    p.add_argument(
        "--trace-speedup", dest="time_scale", type=float, default=1.0, help="replay the trace this many times faster"
    )
    p.add_argument(  # the old spelling: it works, with a warning
        "--time-scale", dest="time_scale", type=float, action=Renamed, new="--trace-speedup", help=argparse.SUPPRESS
    )
    p.add_argument(
        "--request-rate",
        type=float,
        metavar="R",
        help="requests/s, Poisson (default: what the bubbles could hold, estimated from the BubbleTea-off run, "
        f"at most {MAX_DEFAULT_RATE:g}/s)",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the intervals (1 = Poisson)")
    p.add_argument("--input-len", type=int, default=96, help="mean prompt length in tokens (default 96)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="prompt lengths within +-this share (default 0.5)")
    p.add_argument(
        "--iterations",
        type=int,
        help=f"training iterations to simulate (default: the spec's, at most {MAX_DEFAULT_ITERATIONS})",
    )
    p.add_argument("--fwd-ms", type=float, default=DEFAULT_FWD_MS, help="forward ms per layer without a profile")
    p.add_argument("--bus-ms", type=float, default=BUS_S * 1000, help="one hop over the bus (default 0.3 ms)")
    p.add_argument("--seed", type=int, default=0, help="seed of the load (default 0)")
    p.add_argument("--off-only", action="store_true", help="simulate training with BubbleTea off only")
    p.add_argument("--out", default="runs", help="where the run folder goes (default: runs/)")
    p.add_argument("--no-folder", action="store_true", help="write no run folder")
    p.add_argument(
        "--ttft-objective-ms",
        metavar="MS",
        help="the requests' TTFT objective (prefill.ttft_objective_ms; none: no objective): what the bubbles "
        "cannot compute by it is refused, or with --placement auto counted as the decoder's (docs/vllm.md)",
    )
    p.add_argument(
        "--placement",
        choices=("bubbles", "auto", "decoder"),
        help="where prompts may be computed (prefill.placement): with auto, the figures say what share of the "
        "prompt tokens the bubbles take at the objective, the rest going to the decoder",
    )
    p.add_argument(
        "--dispatch",
        choices=("one", "per-dc"),
        default="one",
        help="one dispatcher for the run (default, as live today), or one per datacenter: each owns its DC's "
        "workers' bubbles, credit and queue, and the front door routes each request to the DC predicted to "
        "finish it soonest, on the snapshots they publish (shared/policies/dc_routing.py)",
    )
    p.add_argument(
        "--snapshot-every-ms",
        type=float,
        metavar="MS",
        help="with --dispatch per-dc: how often the dispatchers publish their snapshots and the front door reads "
        "them (default: the live dispatcher's tick, 50 ms)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the figures as one JSON object on stdout (the human lines go to stderr)",
    )


def main(args: argparse.Namespace) -> int:
    """Exit 0 after printing the figures; 2 with one sentence on stderr for a bad spec or option."""
    try:
        spec = load_spec(args.config or os.environ.get("BUBBLETEA_CONFIG") or DEFAULT_SPEC)
        spec = _placed(spec, args.ttft_objective_ms, args.placement)
        limit = spec.training.iteration_limit
        iterations = (
            args.iterations if args.iterations is not None else min(limit or DEFAULT_ITERATIONS, MAX_DEFAULT_ITERATIONS)
        )
        if not args.bus_ms >= 0:
            raise SimError(f"--bus-ms must be >= 0, got {args.bus_ms}")
        options = SimOptions(
            iterations=iterations,
            request_rate=args.request_rate,
            trace=args.trace,
            time_scale=args.time_scale,
            input_len=args.input_len,
            range_ratio=args.range_ratio,
            burstiness=args.burstiness,
            seed=args.seed,
            fwd_ms=args.fwd_ms,
            bus_s=args.bus_ms / 1000,
            bubbletea=not args.off_only,
            max_rate=MAX_DEFAULT_RATE,
            dispatch=DispatchMode(args.dispatch.replace("-", "_")),
            snapshot_every_s=None if args.snapshot_every_ms is None else args.snapshot_every_ms / 1000,
        )
        runs = 1 if args.off_only else 2
        with tqdm(total=iterations * runs, unit="it", desc="simulating", leave=False, disable=None) as bar:
            result = simulate(spec, options, progress=lambda it, now: bar.update(1))
    except (ConfigError, PlacementError, SimError) as exc:
        print(f"bubbletea: error: {exc}", file=sys.stderr)
        return 2
    f = figures(result)
    human = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the JSON alone
    for line in lines(result, f):
        print(line, file=human)
    folder = None if args.no_folder else write_folder(result, f, Path(args.out))
    if folder is not None:
        print(f"  run folder: {folder} (draw it: bubbletea report {folder})", file=human)
    if args.json:
        print(json.dumps({**f, "run_folder": str(folder) if folder is not None else None}))
    return 0


def _placed(spec: ClusterSpec, objective: str | None, placement: str | None) -> ClusterSpec:
    """The spec with --ttft-objective-ms and --placement applied (the knobs the live system reads)."""
    prefill = spec.prefill
    if objective is not None:
        prefill = msgspec.structs.replace(prefill, ttft_objective_ms=objective_ms(objective, "--ttft-objective-ms"))
    if placement is not None:
        prefill = msgspec.structs.replace(prefill, placement=placement)
    return msgspec.structs.replace(spec, prefill=prefill)
