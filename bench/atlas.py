"""Atlas benchmark: live training iteration time versus the analytic pipeline model.

Runs the real services (wan_broker + PP x DP stage workers over a private redis-server) on
WAN-bound specs with a device profile, so each operation counts for a known time, and compares
the measured steady iteration time with the analytic model's, side by side in one run:

* ``fair`` versus ``temporal`` sharing (several TCP connections per transfer);
* one connection versus several (temporal sharing).

    python bench/atlas.py                # 10 iterations per run
    python bench/atlas.py --quick        # under 60 s
    python bench/atlas.py --sweep        # DP degree x (transfer time / compute time), fair vs temporal
    python bench/atlas.py --wan kernel   # the same runs on real TCP shaped by the kernel (root)

`--wan model` (the default): the broker's link model releases each transfer's receiver, as the
simulator computes it. `--wan kernel`: each DC is a network namespace, every link shaped by htb
(its rate; a per-connection cap for window / RTT), the broker granting slots; the bytes take the
time real TCP takes. There the JSON also has `link_efficiency_min`: over the links, the achieved
throughput (bytes / time with a transfer on the link, as the receivers measured it) over
min(link rate, connections x per-connection cap), the most one transfer can reach.

Prints a table, then one JSON object on the last line.
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

from bubbletea.launcher.kernel_wan import KernelWanError
from bubbletea.launcher.procs import spawn, stop_all
from bubbletea.launcher.services import WAN_BROKER
from bubbletea.launcher.train import run_training
from services.stage_worker.outbox import Outbox, wan_transfer
from shared import keys
from shared.bus import Bus
from shared.health import wait_live
from shared.plan import activation_bytes, predict, profile_ms
from shared.policies.wan import LinkModel
from shared.redis_server import EmbeddedRedis
from shared.settings import load_settings
from shared.wire import LinkReport, Ping, decode

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


async def measure(spec: dict[str, Any], url: str, tag: str, workdir: Path) -> dict[str, float]:
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
    model = predict(settings.spec, fwd, bwd, iterations=settings.spec.training.iterations)
    analytic = model.iteration_times[-1]
    late = max((v["late_p99_ms"] for v in result.links.values()), default=0.0)
    efficiency = {}
    for name, link in result.links.items():
        src, dst = name.split("->")
        cap = LinkModel.from_params(settings.spec.link(src, dst)).flow_cap
        if link.get("busy_s", 0.0) > 0:
            efficiency[name] = link["bytes_sent"] / link["busy_s"] / cap
    row = {
        "measured_ms": measured * 1000,
        "model_ms": analytic * 1000,
        "error": abs(measured - analytic) / analytic,
        "broker_late_p99_ms": late,
        "lag_ms": result.lag_ms,
        "act_bytes": activation_bytes(settings.spec),
        "link_efficiency_min": min(efficiency.values(), default=0.0),
    }
    print(
        f"  {tag:<28} measured {row['measured_ms']:8.1f} ms   model {row['model_ms']:8.1f} ms   "
        f"error {row['error'] * 100:5.1f}%   broker late p99 {late:.2f} ms   "
        f"link efficiency {row['link_efficiency_min']:.2f}",
        file=sys.stderr,
        flush=True,
    )
    return row


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
                transfer = wan_transfer(run, payload, f"x{i}", "dc-a", "dc-b", f"bt:{run}:sink", (i,), nbytes)
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


async def main_runs(quick: bool, wan: str = "model") -> dict[str, Any]:
    iters = 6 if quick else 10
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis() as server:
            alone = 0.0
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
    rows = [fair, temporal, one]
    return {
        "wan": wan,
        "iter_ms_fair": round(fair["measured_ms"], 2),
        "iter_ms_temporal": round(temporal["measured_ms"], 2),
        "model_iter_ms_fair": round(fair["model_ms"], 2),
        "model_iter_ms_temporal": round(temporal["model_ms"], 2),
        "speedup_temporal": round(fair["measured_ms"] / temporal["measured_ms"], 3),
        "model_speedup_temporal": round(fair["model_ms"] / temporal["model_ms"], 3),
        "iter_ms_1conn": round(one["measured_ms"], 2),
        "iter_ms_multiconn": round(temporal["measured_ms"], 2),
        "model_iter_ms_1conn": round(one["model_ms"], 2),
        "speedup_multiconn": round(one["measured_ms"] / temporal["measured_ms"], 3),
        "model_speedup_multiconn": round(one["model_ms"] / temporal["model_ms"], 3),
        "model_error_max": round(max(r["error"] for r in rows), 4),
        "broker_late_p99_ms": round(alone, 3),
        "broker_late_p99_ms_under_training": round(max(r["broker_late_p99_ms"] for r in rows), 3),
        "link_efficiency_min": round(min(r["link_efficiency_min"] for r in rows), 3),
        "iterations": iters,
    }


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
        default="model",
        help="model: the broker's link model releases receivers (default); kernel: real TCP shaped by the "
        "kernel between one network namespace per DC (needs root)",
    )
    ap.add_argument("--logs", type=Path, metavar="DIR", help="write each run's service logs to DIR/<run>.log")
    args = ap.parse_args()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        LOGS = args.logs
    if args.wan == "kernel" and args.sweep:
        ap.error("--sweep runs on the model WAN only")
    try:
        out = uvloop.run(main_sweep(args.quick) if args.sweep else main_runs(args.quick, args.wan))
    except KernelWanError as exc:
        print(f"atlas: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))
