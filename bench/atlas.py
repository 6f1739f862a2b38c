"""Atlas benchmark: live training iteration time versus the analytic pipeline model.

Runs the real services (wan_broker + PP x DP stage workers over a private redis-server) on
WAN-bound specs with a device profile, so each operation counts for a known time, and compares
the measured steady iteration time with the analytic model's, side by side in one run:

* ``fair`` versus ``temporal`` sharing (several TCP connections per transfer);
* one connection versus several (temporal sharing).

    python bench/atlas.py                # 10 iterations per run
    python bench/atlas.py --quick        # under 60 s
    python bench/atlas.py --sweep        # DP degree x (transfer time / compute time), fair vs temporal
    python bench/atlas.py --wan kernel   # insist on real TCP shaped by the kernel (root)
    python bench/atlas.py --wan model    # insist on the broker's link model
    python bench/atlas.py --schema       # the JSON keys with their clock and unit

WAN mode. By default the runs use `kernel` where it can run (root, network namespaces, veth and
htb: `bubbletea.launcher.kernel_wan.default_wan_mode`) and `model` elsewhere; the first line of
output says which and why. `--wan` picks one (`--sweep` runs on the model WAN only).

* `kernel`: each DC is a network namespace, every link shaped by htb (its rate; a per-connection
  cap for window / RTT), the broker granting slots; the bytes take the time real TCP takes. The
  analytic model is the one for that link (`LinkModel.from_params(params, "kernel")`): headers as
  htb charges them, no propagation delay (no netem), and the slot protocol's bus hops (request,
  grant, announcement, the receiver's report). Model and measurement are two clocks here, so their
  agreement is the claim (`targets`).
* `model`: the broker's link model releases each transfer's receiver at the time the same
  `LinkSharing` computes for the prediction: agreement checks only the plumbing (the services
  keep the policy's schedule), so it is a validity check (`valid`), not a claim.

`link_efficiency` exists only where bytes cross a socket (`kernel`): over a link, the payload bytes
its receivers took over the time with a transfer on it (the union of the receivers' wire times),
divided by the link's rate. It cannot exceed 1 (headers alone keep it at most 1 / 1.0456 = 0.956).
`link_efficiency_min` is taken over the runs whose single transfer can fill the link (8
connections: fair and temporal); the 1-connection run's transfers each reach a quarter of the
link, so its figure (`link_efficiency_1conn`) measures how many were on the link at once, not how
well the link carried them. In `model` mode they are null: the link model's busy time and bytes
are the policy's own numbers, so the ratio would restate the policy.

Prints a table, then one JSON object on the last line (`SCHEMA` says what each key is).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import uvloop
import yaml

from bench.lib.atlas_summary import SCHEMA, summarize
from bubbletea.launcher.kernel_wan import KernelWanError, default_wan_mode
from bubbletea.launcher.procs import spawn, stop_all
from bubbletea.launcher.services import WAN_BROKER
from bubbletea.launcher.train import run_training
from services.stage_worker.port.outbox import Outbox, wan_transfer
from shared.bus import Bus
from shared.config.settings import load_settings
from shared.config.timescale import profile_ms
from shared.control.health import wait_live
from shared.figures.training import lag_share
from shared.policies.pipeline_plan import activation_bytes, predict
from shared.policies.wan import LinkModel
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import LinkReport, Ping, decode, keys

ROOT = Path(__file__).resolve().parent.parent
#: The base spec: WAN-bound, with a device profile (each operation counts for a known time) and a
#: model small enough that real compute stays well inside the profiled times on 2 cores.
BASE: dict[str, Any] = yaml.safe_load((ROOT / "configs" / "wan-bound.yaml").read_text())
FWD_MS_PER_LAYER: float = BASE["device"]["fwd_ms_per_layer"]
#: `--wan kernel` widens d_model and seq_len by this factor (see `variant`).
KERNEL_WIDEN = 4


def variant(
    *,
    sharing: str,
    connections: int = 8,
    dp: int = 2,
    ratio: float | None = None,
    iterations: int = 10,
    wan: str = "model",
) -> dict[str, Any]:
    """The base spec with the given sharing policy, connections, DP degree, and (optionally) a link
    bandwidth chosen so one activation alone takes `ratio` x one stage's forward time."""
    spec = copy.deepcopy(BASE)
    spec["wan"]["sharing"] = sharing
    spec["wan"]["mode"] = wan
    spec["wan"]["default"]["connections"] = connections
    spec["parallelism"]["dp"] = dp
    # each DC holds exactly one stage's DP group, so every activation crosses the WAN
    spec["datacenters"] = [{"name": "dc-a", "gpus": dp}, {"name": "dc-b", "gpus": dp}]
    spec["training"]["iterations"] = iterations
    if wan == "kernel":
        # Real TCP shapes at packet granularity: an 8 KiB activation is one packet per connection,
        # and htb lets a packet through on an idle class's burst, so fair sharing and the link
        # rate never take hold. Widen the model (activations KERNEL_WIDEN^2 x larger: 128 KiB, ~11
        # packets per connection) and the link as much: the same transfer-to-compute ratio.
        spec["model"]["d_model"] *= KERNEL_WIDEN
        spec["model"]["seq_len"] *= KERNEL_WIDEN
        spec["wan"]["default"]["bandwidth_gbps"] *= KERNEL_WIDEN**2
    if ratio is not None:
        layers_per_stage = spec["model"]["layers"] // spec["parallelism"]["pp"]
        fwd_s = FWD_MS_PER_LAYER * layers_per_stage / 1000
        act = spec["training"]["microbatch_size"] * spec["model"]["seq_len"] * spec["model"]["d_model"] * 4
        spec["wan"]["default"]["bandwidth_gbps"] = act * 8 / (ratio * fwd_s) / 1e9
    # Size the TCP window so that ONE connection reaches a quarter of the link (window / RTT) and
    # the default 8 connections twice the link: the regime where Atlas's extra connections matter.
    link = spec["wan"]["default"]
    rtt_s = 2 * link["latency_ms"] / 1000
    link["tcp_window_mib"] = link["bandwidth_gbps"] * 1e9 / 8 * rtt_s / 4 / (1 << 20)
    return spec


#: Where each run's service logs go (`--logs DIR`); by default they are dropped.
LOGS: Path | None = None


async def measure(spec: dict[str, Any], url: str, tag: str, workdir: Path) -> dict[str, Any]:
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(spec))
    settings = load_settings(path, env={"BUBBLETEA_RUN": f"{tag}-{int(time.time() * 1000)}"})
    out = io.StringIO()
    try:
        result = await run_training(settings, url, out=out, progress=False)
    finally:  # a failed run's logs are the ones most wanted
        if LOGS is not None:
            await asyncio.to_thread((LOGS / f"{tag}.log").write_text, out.getvalue())
    measured = result.steady_iteration_s()
    fwd, bwd = profile_ms(settings.spec) or (FWD_MS_PER_LAYER, 2 * FWD_MS_PER_LAYER)
    model = predict(settings.spec, fwd, bwd, iterations=settings.spec.training.iteration_limit or 1)
    analytic = model.iteration_times[-1]
    late = max((v["late_p99_ms"] for v in result.links.values()), default=0.0)
    mode = settings.spec.wan.mode
    # Bytes cross a socket only in kernel mode: there, payload bytes over the union of the
    # receivers' wire times, over the link's rate (module docstring). In model mode: none.
    efficiency: dict[str, float] = {}
    fills = True
    for name in (f"{a}->{b}" for a, b in model_links(settings.spec)):
        src, dst = name.split("->")
        link = LinkModel.from_params(settings.spec.link(src, dst), mode)
        fills = fills and link.flow_cap >= link.bandwidth
        stats = result.links.get(name, {})
        if mode != "model" and stats.get("busy_s", 0.0) > 0:
            efficiency[name] = stats["bytes_sent"] / stats["busy_s"] / link.bandwidth
    workers = settings.spec.parallelism.pp * settings.spec.parallelism.dp
    # the slot requests' bus hops, as the broker logged them (granting modes): the model's request_s
    hops = [float(h) for h in re.findall(r'msg="slot granted" .*? hop_ms=([0-9.]+)', out.getvalue())]
    row: dict[str, Any] = {
        "measured_ms": measured * 1000,
        "model_ms": analytic * 1000,
        "error": abs(measured - analytic) / analytic,
        "broker_late_p99_ms": late,
        "lag_ms": result.lag_ms,
        "lag_share": lag_share(result.lag_ms, workers, result.iteration_s),
        "act_bytes": activation_bytes(settings.spec),
        "link_efficiency": min(efficiency.values()) if efficiency else None,
        "links_carried": sorted(efficiency),
        "fills_link": fills,
        "hops_ms": hops,
    }
    eff = "n/a (model)" if row["link_efficiency"] is None else f"{row['link_efficiency']:.2f}"
    print(
        f"  {tag:<28} measured {row['measured_ms']:8.1f} ms   model {row['model_ms']:8.1f} ms   "
        f"error {row['error'] * 100:5.1f}%   compute lag {row['lag_share'] * 100:4.1f}%   "
        + (f"broker late p99 {late:.2f} ms   " if mode == "model" else "")
        + (f"control hop p50 {statistics.median(hops):.2f} ms   " if hops else "")
        + f"link efficiency {eff}",
        file=sys.stderr,
        flush=True,
    )
    return row


def model_links(spec: Any) -> list[tuple[str, str]]:
    """The directed links the runs' activations and gradients cross (both DCs of the variant)."""
    names = [dc.name for dc in spec.datacenters]
    return [(a, b) for a in names for b in names if a != b]


async def broker_accuracy(url: str, workdir: Path, n: int) -> float:
    """The broker alone on loopback: `n` transfers at varied moments over one link; returns its
    delivery lateness p99 (ms) versus the policy's arrival times, from its own LinkReport."""
    spec = variant(sharing="temporal")
    # its own link: 100 Mb/s, 5 ms one way, so transfers come and go rather than pile up
    spec["wan"]["default"] = {"latency_ms": 5.0, "bandwidth_gbps": 0.1, "tcp_window_mib": 4.0, "connections": 8}
    path = workdir / "broker.yaml"
    path.write_text(yaml.safe_dump(spec))
    run = f"acc-{int(time.time() * 1000)}"
    env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_RUN": run}
    broker = await spawn(WAN_BROKER, env, out=io.StringIO())
    try:
        async with Bus(url, name="bench") as bus:
            await wait_live(bus.redis, "wan_broker", timeout_s=60)
            rng = random.Random(0)
            outbox = Outbox(bus)  # the path a worker's cross-DC send takes: outbox, then broker
            for i in range(n):
                payload = Ping(seq=i, sent_ns=0)
                nbytes = rng.choice([200, 2_000, 20_000])
                transfer = wan_transfer(
                    run, payload, f"x{i}", "dc-a", "dc-b", f"{keys.PREFIX}:{keys.run_tag(run)}:sink", (i,), nbytes
                )
                outbox.send(keys.wan_stream(run), transfer)
                await asyncio.sleep(rng.uniform(0.0, 0.004))  # arrivals spread over time, bursts included
            await outbox.close()
            cursor = "0"
            while True:
                reply: Any = await bus.redis.xread({keys.events_stream(run): cursor}, block=3000)
                assert reply, "no link report from the broker"
                for entry_id, fields in reply[0][1]:
                    cursor = entry_id.decode()
                    msg = decode(fields[b"m"])
                    if isinstance(msg, LinkReport) and msg.transfers == n:
                        return msg.late_p99_ms
    finally:
        await stop_all([broker])


async def main_runs(quick: bool, wan: str = "model", wan_why: str = "--wan") -> dict[str, Any]:
    iters = 6 if quick else 10
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis() as server:
            alone: float | None = None
            if wan == "model":  # first, while the machine is quiet: the broker's own timing accuracy
                alone = await broker_accuracy(server.url, Path(tmp), 500 if quick else 1000)
                print(f"broker alone on loopback: delivery late p99 {alone:.3f} ms", file=sys.stderr)
            print(f"Atlas ({wan} WAN): live services vs analytic model (steady iteration time)", file=sys.stderr)
            fair = await measure(
                variant(sharing="fair", iterations=iters, wan=wan), server.url, "fair-8conn", Path(tmp)
            )
            temporal = await measure(
                variant(sharing="temporal", iterations=iters, wan=wan), server.url, "temporal-8conn", Path(tmp)
            )
            one = await measure(
                variant(sharing="temporal", connections=1, iterations=iters, wan=wan),
                server.url,
                "temporal-1conn",
                Path(tmp),
            )
    return summarize(wan, wan_why, iters, fair, temporal, one, alone)


async def main_sweep(quick: bool) -> dict[str, Any]:
    iters = 5 if quick else 8
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis() as server:
            for dp in (1, 2, 4):
                for ratio in (0.5, 1.0, 2.0):
                    row: dict[str, Any] = {"dp": dp, "ratio": ratio}
                    for sharing in ("fair", "temporal"):
                        r = await measure(
                            variant(sharing=sharing, dp=dp, ratio=ratio, iterations=iters),
                            server.url,
                            f"sweep-dp{dp}-r{ratio}-{sharing}",
                            Path(tmp),
                        )
                        row[f"{sharing}_ms"], row[f"{sharing}_model_ms"] = r["measured_ms"], r["model_ms"]
                        row[f"{sharing}_lag_ms"] = r["lag_ms"]
                    row["speedup"] = row["fair_ms"] / row["temporal_ms"]
                    row["model_speedup"] = row["fair_model_ms"] / row["temporal_model_ms"]
                    table.append(row)
    print("\n| DP | transfer/compute | fair ms (model) | temporal ms (model) | speedup (model) |", file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for r in table:
        print(
            f"| {r['dp']} | {r['ratio']} | {r['fair_ms']:.1f} ({r['fair_model_ms']:.1f}) | "
            f"{r['temporal_ms']:.1f} ({r['temporal_model_ms']:.1f}) | {r['speedup']:.2f} ({r['model_speedup']:.2f}) |",
            file=sys.stderr,
        )
    errors = [abs(r[f"{s}_ms"] - r[f"{s}_model_ms"]) / r[f"{s}_model_ms"] for r in table for s in ("fair", "temporal")]
    return {
        "sweep": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in table],
        "model_error_max": round(max(errors), 4),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations; the main runs finish in under 60 s")
    ap.add_argument("--sweep", action="store_true", help="DP x transfer/compute sweep of fair vs temporal (minutes)")
    ap.add_argument(
        "--wan",
        choices=("model", "kernel"),
        default=None,
        help="kernel: real TCP shaped by the kernel between one network namespace per DC (needs root); "
        "model: the broker's link model releases receivers. Default: kernel where it can run, else model",
    )
    ap.add_argument("--logs", type=Path, metavar="DIR", help="write each run's service logs to DIR/<run>.log")
    ap.add_argument("--schema", action="store_true", help="print the JSON keys with their clock and unit, and exit")
    args = ap.parse_args()
    if args.schema:
        for key, what in SCHEMA.items():
            print(f"{key}: {what}")
        sys.exit(0)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        LOGS = args.logs
    if args.wan == "kernel" and args.sweep:
        ap.error("--sweep runs on the model WAN only")
    if args.wan is not None:
        wan, why = args.wan, "--wan"
    elif args.sweep:
        wan, why = "model", "--sweep runs on the model WAN only"
    else:
        wan, why = default_wan_mode()
    print(f"atlas: WAN mode {wan} ({why})", file=sys.stderr, flush=True)  # the first line, whatever follows
    try:
        out = uvloop.run(main_sweep(args.quick) if args.sweep else main_runs(args.quick, wan, why))
    except KernelWanError as exc:
        print(f"atlas: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))
