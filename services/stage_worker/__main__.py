"""python -m services.stage_worker: one (DP replica, PP stage) of the training pipeline."""

from __future__ import annotations

import sys

from services.stage_worker.worker import SERVICE, serve
from shared.service import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(
        SERVICE,
        serve,
        argv,
        description="Stage worker: leases a free (replica, stage) slot and trains it with real torch.",
    )


if __name__ == "__main__":
    sys.exit(main())
