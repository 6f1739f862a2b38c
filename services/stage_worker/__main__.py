"""python -m services.stage_worker: one (DP replica, PP stage) of the training pipeline."""

from __future__ import annotations

import logging
import os
import sys

from services.stage_worker.worker import SERVICE, check_device, serve
from shared.service.main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(
        SERVICE,
        serve,
        argv,
        description="Stage worker: leases a free (replica, stage) slot and trains it with real torch.",
        check=check_device,
    )


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown. When a run stops, a data-plane thread may still
    be inside gloo, waiting on a peer that is stopping too; tearing torch.distributed's C++ objects
    down under it ends in std::terminate (SIGABRT), turning a clean exit into a crash. Everything
    that matters is already done when `main` returns: the bus is closed, the lease released or
    marked; only the output is left to flush."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
