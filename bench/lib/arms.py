"""The arms a bench of several arms runs (bench/churn.py, faults.py, takeover.py): `--arms`."""

from __future__ import annotations

import argparse
from collections.abc import Collection


def arms_of(p: argparse.ArgumentParser, value: str, known: Collection[str]) -> list[str]:
    """The arms named in `--arms` (comma-separated, in order); a name not `known` is a usage error."""
    arms = [a.strip() for a in value.split(",") if a.strip()]
    if bad := [a for a in arms if a not in known]:
        p.error(f"--arms: unknown {', '.join(bad)} (choose from {', '.join(known)})")
    return arms
