"""The one table of BubbleTea's services: what each runs and how its health is checked.

`bubbletea demo`/`up` start processes from this table; `compose.yaml` must describe the same
services with the same commands (a test compares them), so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceDef:
    name: str
    #: Python module run as ``python -m MODULE`` (in compose: the container command).
    module: str
    #: Whether the service serves HTTP (then health is ``GET /health``); else its Redis heartbeat.
    http: bool = False


SERVICES: tuple[ServiceDef, ...] = (ServiceDef("prefill_queue", "services.prefill_queue", http=True),)


def command(svc: ServiceDef) -> list[str]:
    """The command line (after the interpreter) that starts `svc`."""
    return ["-m", svc.module]
