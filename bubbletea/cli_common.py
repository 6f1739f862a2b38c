"""Options several `bubbletea` commands share (the WAN mode, the time-scale cap, -v), how they
reach the processes a command starts (through the environment those inherit), and the one error
prefix every command's user errors carry."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from shared.config import env_values
from shared.config.spec import ConfigError
from shared.config.timescale import WARN_SCALE

#: Every user error of every command starts with this (argparse's own usage errors included).
PREFIX = "bubbletea: error: "
#: Every command that reads a spec reads it the same way (`shared.config.settings.load_settings`).
CONFIG_HELP = "cluster spec (default: $BUBBLETEA_CONFIG, else configs/demo.yaml)"


def add_spec_arguments(p: Any) -> None:
    """The spec, as every command that reads one takes it: `bubbletea plan SPEC` or `--config SPEC`."""
    p.add_argument("spec", nargs="?", metavar="SPEC", help="cluster spec file (YAML; the same as --config)")
    p.add_argument("--config", help=CONFIG_HELP)


def merge_spec_argument(args: Any) -> None:
    """`args.config` from the positional SPEC (after parsing); two different specs are an error."""
    spec = getattr(args, "spec", None)
    if spec is None:
        return
    if args.config and args.config != spec:
        raise ConfigError(f"two specs named ({spec} and --config {args.config}): name one")
    args.config = spec


def run_id_argument(value: str) -> str:
    """The `type` of every `--run`: a run id as BUBBLETEA_RUN takes it (no brace: the run id is the hash
    tag of its Redis keys)."""
    try:
        return env_values.run_id(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("BUBBLETEA_RUN: ")) from None


class CommandError(Exception):
    """A mistake the user can fix, said in one line (after `PREFIX`); exits with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class CommandParser(argparse.ArgumentParser):
    """argparse, with its usage errors under the one prefix (a subcommand's too: not
    `bubbletea plan: error:`)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{PREFIX}{message}\n")


def add_verbose_argument(p: argparse.ArgumentParser, top: bool = False) -> None:
    """-v/--verbose, before or after the subcommand (`bubbletea -v plan` = `bubbletea plan -v`)."""
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        # a subcommand's default must not overwrite the top level's -v
        default=False if top else argparse.SUPPRESS,
        help="say more: every service's info-level log lines (up, train), and the traceback of an internal error",
    )


def add_wan_argument(p: argparse.ArgumentParser, default: str = "the spec's wan.mode, model") -> None:
    p.add_argument(
        "--wan",
        choices=("model", "kernel", "none"),
        help=f"how cross-DC bytes meet the WAN (default: {default}): model = the broker's link "
        "model releases receivers; kernel = one network namespace per DC, links shaped by the kernel, the broker "
        "granting slots (root only); none = a real network, nothing emulated (docs/config.md#wan-modes)",
    )


def add_scale_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-time-scale",
        type=float,
        metavar="K",
        help="refuse to run if keeping the device profile on this machine would take a time scale above K "
        "(default: no cap: a slow or busy machine runs at the scale it needs, with a warning above "
        f"{WARN_SCALE:g}); BUBBLETEA_MAX_TIME_SCALE sets it too",
    )


def scale_override(args: argparse.Namespace) -> None:
    """`--max-time-scale K`, here and in what the command starts: through the environment."""
    if args.max_time_scale is not None:
        os.environ["BUBBLETEA_MAX_TIME_SCALE"] = f"{args.max_time_scale:g}"


def wan_override(args: argparse.Namespace) -> None:
    """`--wan MODE` overrides `wan.mode` here and in every process the command starts (they read
    the spec themselves): through the environment they inherit."""
    if getattr(args, "wan", None):
        os.environ["BUBBLETEA_WAN"] = args.wan
