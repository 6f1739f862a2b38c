"""python -m services.dispatcher: the BubbleTea dispatcher for the run named by $BUBBLETEA_RUN."""

from __future__ import annotations

import sys

from services.dispatcher.dispatcher import SERVICE
from services.dispatcher.serve import serve, served_dc
from shared.service.main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(
        SERVICE,
        serve,
        argv,
        description="BubbleTea dispatcher: packs queued prefill requests into the bubbles the run's workers announce "
        "(with bubbletea.dispatch: per_dc, those of the datacenter BUBBLETEA_DC names).",
        check=served_dc,
    )


if __name__ == "__main__":
    sys.exit(main())
