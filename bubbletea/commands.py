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

import uvloop

from bubbletea import cli_drain, cli_inspect, cli_redis, cli_up
from bubbletea.cli_common import (
    CommandError,
    CommandParser,
    add_scale_argument,
    add_spec_arguments,
    add_verbose_argument,
    add_wan_argument,
    run_id_argument,
    scale_override,
    wan_override,
)
from bubbletea.preflight import check_run
from shared.config.settings import load_settings
from shared.config.timescale import SHARE
from shared.runtime.logs import setup_logging

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
    check_run(settings)  # what check-config checks, before anything starts
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

    if args.iterations is not None:  # here and in every process train starts: through the environment
        if args.iterations < 1:
            raise CommandError(f"--iterations must be >= 1, got {args.iterations}")
        os.environ["BUBBLETEA_ITERATIONS"] = str(args.iterations)
    settings = load_settings(args.config)
    check_run(settings)  # what check-config checks, before anything starts
    if args.run:
        settings = dataclasses.replace(settings, run=args.run)
    elif settings.run == "run":
        settings = dataclasses.replace(settings, run=f"train-{int(time.time())}")
    setup_logging("train", "WARNING")
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
            # the absolute path: a spec reads a relative one from its own folder, not from here
            where = Path(save).absolute()
            print(f"==> saved the trained model to {save} (set prefill.checkpoint: {where} to serve it)", flush=True)
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


def _simulate(args: argparse.Namespace) -> int:
    from sim.command import main as simulate_main

    check_run(load_settings(args.config))  # what check-config checks, before anything starts
    return simulate_main(args)


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
    _add_demo(sub)
    cli_up.add_parser(sub)
    _add_train(sub)
    _add_simulate(sub)
    cli_inspect.add_parsers(sub)
    cli_drain.add_parser(sub)
    _add_report(sub)
    from bubbletea.initmodel import add_parser as add_init_model

    add_init_model(sub)
    cli_redis.add_parser(sub)
    for name, parser in sub.choices.items():
        if name != "report":  # its own parser (bubbletea.report.command) owns the arguments
            add_verbose_argument(parser)
    return ap


def _add_demo(sub: Any) -> None:
    """`bubbletea demo`: the main job."""
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
    add_spec_arguments(p)
    p.add_argument("--hold", action="store_true", help="keep the front door running after the demo until Ctrl-C")
    add_wan_argument(
        p, "kernel where it can run (root, network namespaces), else model; a spec naming wan.mode keeps it"
    )
    add_scale_argument(p)
    p.add_argument("--out", default="runs", help="where the run folder goes (default: runs/)")
    p.set_defaults(func=_demo)


def _add_train(sub: Any) -> None:
    """`bubbletea train`: one training job over live services."""
    p = sub.add_parser(
        "train",
        help="run one training job over live services (broker + a worker per slot)",
        description="Start the wan_broker and one stage_worker per (replica, stage) slot, train for "
        "training.iterations, print loss and iteration time, stop. Uses an embedded Redis unless REDIS_URL is set.",
    )
    add_spec_arguments(p)
    p.add_argument("--run", type=run_id_argument, help="run id scoping streams and leases (default: train-<unix time>)")
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
    p.add_argument(
        "--iterations",
        type=int,
        help="train this many iterations (default: the spec's training.iterations; as BUBBLETEA_ITERATIONS)",
    )
    p.set_defaults(func=_train)


def _add_simulate(sub: Any) -> None:
    """`bubbletea simulate`: the spec on a virtual clock (its arguments are the simulator's)."""
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


def _add_report(sub: Any) -> None:
    """`bubbletea report`: its own parser (`bubbletea.report.command`) reads the arguments."""
    p = sub.add_parser(
        "report",
        help="draw a run folder's pictures and comparison table",
        description="Read RUN_DIR (written by `bubbletea demo`) and write the pipeline timelines, the "
        "utilization chart, the TTFT distribution and the Markdown table. See docs/report.md.",
        add_help=False,
    )
    p.set_defaults(func=None)
