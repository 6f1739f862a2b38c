"""The `bubbletea` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec
import uvloop

from shared.config import ConfigError, load_spec
from shared.logs import setup_logging
from shared.settings import load_settings

DESCRIPTION = """\
BubbleTea: pipeline-parallel training across datacenters (Atlas) with prefill-as-a-service
in the pipeline bubbles (BubbleTea), as microservices over Redis Streams.

Environment: REDIS_URL (unset: an embedded redis-server is started), BUBBLETEA_CONFIG,
BUBBLETEA_LOG_LEVEL, BUBBLETEA_HTTP_HOST, BUBBLETEA_HTTP_PORT. See docs/config.md.
"""


def _demo(args: argparse.Namespace) -> int:
    from shared.launcher.demo import run_demo

    settings = load_settings(args.config)
    setup_logging("demo", "WARNING" if settings.log_level == "INFO" else settings.log_level)
    return uvloop.run(run_demo(settings, hold=args.hold))


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


def _redis(args: argparse.Namespace) -> int:
    import signal

    from shared.redis_server import EmbeddedRedis

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bubbletea", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "demo",
        help="run the main job: start the system, show it working, stop cleanly",
        description="Start Redis (embedded unless REDIS_URL is set) and every service as a "
        "process, check their health and the bus, then stop everything.",
    )
    p.add_argument("--config", help="cluster spec (default: $BUBBLETEA_CONFIG or configs/demo.yaml)")
    p.add_argument("--hold", action="store_true", help="keep the system running until Ctrl-C")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "check-config",
        help="validate a cluster spec file",
        description="Load and validate a cluster spec; exit 2 with a message naming the bad field.",
    )
    p.add_argument("file", help="cluster spec file (YAML)")
    p.add_argument("--show", action="store_true", help="print the spec with every default filled in")
    p.set_defaults(func=_check_config)

    p = sub.add_parser(
        "redis",
        help="run an embedded redis-server on a free port until Ctrl-C",
        description="Start a private redis-server (from the PATH or the packaged binary) "
        "and print its REDIS_URL, for running services by hand.",
    )
    p.add_argument("--port", type=int, default=None, help="port to listen on (default: a free one)")
    p.set_defaults(func=_redis)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"bubbletea: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bubbletea: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
