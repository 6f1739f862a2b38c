"""python -m services.prefill_queue: read settings, set up logging, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import sys

from services.prefill_queue.api import served_model
from services.prefill_queue.app import SERVICE, create_app
from services.prefill_queue.server import Runner
from shared.config.settings import Settings
from shared.service.main import run_service, serve_app


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    http = settings.spec.http
    await serve_app(create_app(settings), http.host, http.port, stop, runner_class=Runner)


def main(argv: list[str] | None = None) -> int:
    # the served model's checkpoint is checked before anything else: a front door that cannot say
    # what it serves refuses to start (it would listen and answer every request with an error)
    check = lambda s: served_model(s.spec.prefill)  # noqa: E731
    return run_service(SERVICE, serve, argv, description="BubbleTea HTTP prefill front door.", check=check)


if __name__ == "__main__":
    sys.exit(main())
