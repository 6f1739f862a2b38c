"""Options several `bubbletea` commands share (the WAN mode, the time-scale cap), and how they
reach the processes a command starts: through the environment those inherit."""

from __future__ import annotations

import argparse
import os

from shared.spec.timescale import WARN_SCALE


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
