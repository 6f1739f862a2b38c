"""python -m services.wan_broker: the Atlas slot arbiter / WAN emulator."""

from __future__ import annotations

import sys

from services.wan_broker.broker import SERVICE, serve
from shared.service.main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, serve, argv, description="Atlas WAN broker: shares each DC link by the spec's policy.")


if __name__ == "__main__":
    sys.exit(main())
