"""python -m services.decoder: continues prefilled prompts from their KV caches (max_tokens > 1)."""

from __future__ import annotations

import sys

from services.decoder.decoder import SERVICE, serve
from shared.service.main import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(
        SERVICE,
        serve,
        argv,
        description="Decoder: loads a prompt's KV cache from its handle and generates the rest of the completion.",
    )


if __name__ == "__main__":
    sys.exit(main())
