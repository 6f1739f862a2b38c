"""The `bubbletea` command's subcommands: a parser and a thin wrapper per job (`bubbletea.cli` is
the entry point and turns every user error into one line).

Over 300 lines on purpose: the one `bubbletea` command, a parser and thin wrapper per subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import uvloop

from bubbletea import cli_up
from bubbletea.cli_common import (
    CommandError,
    CommandParser,
    add_scale_argument,
    add_verbose_argument,
    add_wan_argument,
    scale_override,
    wan_override,
)
from shared.runtime.logs import setup_logging
from shared.spec.config import load_spec
from shared.spec.settings import load_settings
from shared.spec.timescale import SHARE

T = TypeVar("T")

DESCRIPTION = """\
BubbleTea: pipeline-parallel training across datacenters (Atlas) with prefill-as-a-service
in the pipeline bubbles (BubbleTea), as microservices over Redis Streams.

Environment: REDIS_URL (unset: an embedded redis-server is started), BUBBLETEA_CONFIG,
BUBBLETEA_LOG_LEVEL, BUBBLETEA_HTTP_HOST, BUBBLETEA_HTTP_PORT. See docs/config.md.
"""


def _demo(args: argparse.Namespace) -> int:
    wan_override(args)
    scale_override(args)
    from bubbletea.launcher.demo import run_demo
    from bubbletea.launcher.wan_modes import launcher_wan_mode

    settings = load_settings(args.config)
    mode, why, defaulted = launcher_wan_mode(settings, os.environ)
    if defaulted:  # every process the demo starts reads the mode from the environment it inherits
        os.environ["BUBBLETEA_WAN"] = mode
        settings = load_settings(args.config)
    print(f"==> WAN mode {mode} ({why})", flush=True)  # the first line of output
    setup_logging("demo", "WARNING" if settings.log_level == "INFO" else settings.log_level)
    return uvloop.run(run_demo(settings, hold=args.hold, out_root=Path(args.out)))


def _train(args: argparse.Namespace) -> int:
    wan_override(args)
    import dataclasses
    import time

    from bubbletea.launcher.procs import open_redis
    from bubbletea.launcher.train import run_training

    settings = load_settings(args.config)
    if args.run:
        settings = dataclasses.replace(settings, run=args.run)
    elif settings.run == "run":
        settings = dataclasses.replace(settings, run=f"train-{int(time.time())}")
    setup_logging("train", "WARNING")
    from shared.model.training import check_training

    check_training(settings.spec)  # a model or data the workers cannot train is refused here, in one line
    from shared.model.trainstate import check_resume, check_save_target

    if args.resume:
        check_resume(Path(args.resume), settings.spec)  # and a save it cannot continue from
    if args.save:
        check_save_target(Path(args.save))  # or a directory a save would replace
    url, embedded, _ = open_redis(settings.redis_url)
    try:
        spec = settings.spec
        print(
            f"==> run {settings.run}: PP={spec.parallelism.pp} DP={spec.parallelism.dp} {spec.training.schedule}, "
            f"{spec.training.iterations} iterations, WAN sharing {spec.wan.sharing}, bus {url}",
            flush=True,
        )
        save = Path(args.save) if args.save else None
        resume = Path(args.resume).absolute() if args.resume else None
        folder = Path(args.out) / settings.run
        folder.mkdir(parents=True, exist_ok=True)
        print(f"==> per-iteration loss and tokens/s also in {folder / 'train.jsonl'}", flush=True)
        with (folder / "train.jsonl").open("a", encoding="utf-8") as log:
            job = run_training(
                settings, url, progress=True, quiet=not args.verbose, save=save, resume=resume, record=log
            )
            try:
                result = uvloop.run(_cancelled_by_sigterm(job))
            except asyncio.CancelledError:  # SIGTERM (Ctrl-C arrives as KeyboardInterrupt instead)
                print("bubbletea: terminated", file=sys.stderr)
                return 143
        print(
            f"==> done: steady iteration time {result.steady_iteration_s() * 1000:.1f} ms, "
            f"final loss {result.losses[-1]:.4f}",
            flush=True,
        )
        if save is not None:
            print(f"==> saved the trained model to {save} (set prefill.checkpoint: {save} to serve it)", flush=True)
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


async def _cancelled_by_sigterm(job: Coroutine[Any, Any, T]) -> T:
    """Run `job`, cancelling it on SIGTERM as Ctrl-C does (so a `--save` run stops cleanly)."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await job
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _plan(args: argparse.Namespace) -> int:
    from bubbletea.plan import plan_report
    from shared.spec.plan import profile_ms

    spec = load_spec(args.config)
    prof = profile_ms(spec)
    if prof is not None:
        fwd, bwd, source = prof[0], prof[1], "device profile"
    else:
        fwd, bwd, source = args.fwd_ms, args.fwd_ms * 2, f"--fwd-ms {args.fwd_ms} (no device profile in the spec)"
    print(plan_report(spec, fwd, bwd, source))
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from sim.command import main as simulate_main

    return simulate_main(args)


def _health(args: argparse.Namespace) -> int:
    """Exit 0 if SERVICE has a live heartbeat in Redis (for compose healthchecks), else 1."""
    import asyncio

    from redis.asyncio import Redis

    from shared.control.health import live_instances

    settings = load_settings(args.config)

    async def check() -> list[dict[str, object]]:
        r = Redis.from_url(settings.require_redis_url(), protocol=2)
        try:
            return await live_instances(r, args.service)
        finally:
            await r.aclose()

    live = asyncio.run(check())
    for inst in live:
        print(f"{args.service} {inst['instance']} ok")
    if not live:
        print(f"{args.service}: no live instance (no heartbeat in Redis)", file=sys.stderr)
    return 0 if live else 1


def _check_config(args: argparse.Namespace) -> int:
    spec = load_spec(args.file)
    if args.show:
        print(msgspec.yaml.encode(spec).decode())
    gpus = sum(d.gpus for d in spec.datacenters)
    print(
        f"{args.file}: ok ({len(spec.datacenters)} datacenters, {gpus} GPUs, "
        f"PP={spec.parallelism.pp} DP={spec.parallelism.dp} TP={spec.parallelism.tp}, "
        f"schedule={spec.training.schedule}, sharing={spec.wan.sharing})"
    )
    return 0


def _port(value: str) -> int:
    """An argparse type: a TCP port a server can listen on."""
    if not value.isdigit() or not 1 <= int(value) <= 65_535:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {value!r}")
    return int(value)


def _redis(args: argparse.Namespace) -> int:
    import socket

    from shared.runtime.redis_server import EmbeddedRedis

    if args.port is not None:  # taken? say so in one line, before redis-server says it in twenty
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", args.port))
            except OSError as exc:
                why = exc.strerror or str(exc)
                raise CommandError(
                    f"--port {args.port}: {why}: choose another port, or leave --port out for one", 1
                ) from None
    setup_logging("redis", "WARNING")
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # delivered to sigwait, not the default handler
    server = EmbeddedRedis(port=args.port).start()
    print(f"REDIS_URL={server.url}", flush=True)
    try:
        signal.sigwait(stop_signals)
    finally:
        server.stop()
    return 0


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, as `pip show bubbletea` says)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bubbletea")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(prog="bubbletea", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verbose_argument(ap, top=True)
    ap.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "demo",
        help="the main job: fair vs Atlas vs Atlas+BubbleTea, with a table and pictures",
        description="Start Redis (embedded unless REDIS_URL is set) and the front door, then train the spec "
        "three ways over live services: fair WAN sharing with one connection, Atlas (temporal sharing, several "
        "connections), and Atlas + BubbleTea while the load generator sends prefill requests over HTTP. Prints "
        "a comparison table and writes a run folder with the JSON, the table and the pictures. First it measures "
        f"this machine and picks the device time scale that keeps real compute within {SHARE:.0%} of the profiled time "
        "(times are then reported in emulated ms); BUBBLETEA_TIME_SCALE=K sets it instead.",
    )
    p.add_argument("--config", help="cluster spec (default: $BUBBLETEA_CONFIG or configs/demo.yaml)")
    p.add_argument("--hold", action="store_true", help="keep the front door running after the demo until Ctrl-C")
    add_wan_argument(
        p, "kernel where it can run (root, network namespaces), else model; a spec naming wan.mode keeps it"
    )
    add_scale_argument(p)
    p.add_argument("--out", default="runs", help="where the run folder goes (default: runs/)")
    p.set_defaults(func=_demo)

    cli_up.add_parser(sub)

    p = sub.add_parser(
        "train",
        help="run one training job over live services (broker + a worker per slot)",
        description="Start the wan_broker and one stage_worker per (replica, stage) slot, train for "
        "training.iterations, print loss and iteration time, stop. Uses an embedded Redis unless REDIS_URL is set.",
    )
    p.add_argument("--config", help="cluster spec (default: $BUBBLETEA_CONFIG or configs/demo.yaml)")
    p.add_argument("--run", help="run id scoping streams and leases (default: train-<unix time>)")
    add_wan_argument(p)
    p.add_argument(
        "--save",
        metavar="DIR",
        help="write the trained model to DIR after the last iteration (and every training.save_every): a Hugging "
        "Face directory (config.json, model.safetensors, tokenizer.json; the small GPT as GPT-2) that "
        "prefill.checkpoint and transformers load, plus optimizer/ and trainer_state.json for --resume",
    )
    p.add_argument("--out", default="runs", help="the run folder goes here: <out>/<run>/train.jsonl (default: runs)")
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from a directory --save wrote: its weights, optimizer state and iteration, up to "
        "training.iterations in total (same model and pipeline split; losses as an uninterrupted run's)",
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "plan",
        help="print the placement, cross-DC hops and the analytic iteration time",
        description="The placement of the spec's stages on its datacenters (parallelism.placement: Atlas's or "
        "round-robin), the WAN hops, and the analytic "
        "pipeline model's iteration time and bubble fraction for each sharing policy.",
    )
    p.add_argument("--config", default=None, help="cluster spec (default: configs/demo.yaml)")
    p.add_argument(
        "--fwd-ms",
        type=float,
        default=10.0,
        help="forward ms per layer per microbatch when the spec has no device profile (default 10)",
    )
    p.set_defaults(func=lambda a: _plan(_with_default_config(a)))

    p = sub.add_parser(
        "simulate",
        help="simulate the spec on a virtual clock with BubbleTea off and on (any scale, in seconds)",
        description="Run the spec's training and prefill serving on a virtual clock, with the very policies the "
        "live services run (placement, schedules, WAN sharing, bubble prediction, dispatch, fill, prefill cost). "
        "Prints iteration time, bubble fraction, utilization with BubbleTea off and on, fill ratio, training "
        "slowdown, TTFT percentiles, requests served and expired; writes a run folder that `bubbletea report` "
        "draws. See docs/simulator.md.",
    )
    from sim.command import add_arguments as add_simulate_arguments

    add_simulate_arguments(p)
    p.set_defaults(func=_simulate)

    p = sub.add_parser(
        "check-config",
        help="validate a cluster spec file",
        description="Load and validate a cluster spec; exit 2 with a message naming the bad field.",
    )
    p.add_argument("file", help="cluster spec file (YAML)")
    p.add_argument("--show", action="store_true", help="print the spec with every default filled in")
    p.set_defaults(func=_check_config)

    p = sub.add_parser(
        "health",
        help="exit 0 if a service has a live heartbeat in Redis (REDIS_URL)",
        description="Check the heartbeat keys services refresh in Redis; used by compose healthchecks.",
    )
    p.add_argument("service", help="service name, e.g. wan_broker or stage_worker")
    p.add_argument("--config", help="cluster spec (default: $BUBBLETEA_CONFIG or configs/demo.yaml)")
    p.set_defaults(func=_health)

    p = sub.add_parser(
        "report",
        help="draw a run folder's pictures and comparison table",
        description="Read RUN_DIR (written by `bubbletea demo`) and write the pipeline timelines, the "
        "utilization chart, the TTFT distribution and the Markdown table. See docs/report.md.",
        add_help=False,
    )
    p.set_defaults(func=None)

    from bubbletea.initmodel import add_parser as add_init_model

    add_init_model(sub)

    p = sub.add_parser(
        "redis",
        help="run an embedded redis-server on a free port until Ctrl-C",
        description="Start a private redis-server (from the PATH or the packaged binary) "
        "and print its REDIS_URL, for running services by hand.",
    )
    p.add_argument("--port", type=_port, default=None, help="port to listen on (default: a free one)")
    p.set_defaults(func=_redis)
    for name, parser in sub.choices.items():
        if name != "report":  # its own parser (bubbletea.report.command) owns the arguments
            add_verbose_argument(parser)
    return ap


def _with_default_config(args: argparse.Namespace) -> argparse.Namespace:
    if args.config is None:
        from shared.spec.settings import DEFAULT_SPEC

        args.config = str(DEFAULT_SPEC)
    return args
