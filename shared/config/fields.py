"""The cluster spec's building blocks: the strict base of every section, constrained field types, clock marks."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

# Reusable constrained types: msgspec reports a violation as e.g. "Expected `int` >= 1 - at `$.x`".
Name = Annotated[
    str, Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="lower-case letters, digits, '-' and '_', 1-63 chars")
]
Count = Annotated[int, Meta(ge=1, le=1_000_000)]
Millis = Annotated[float, Meta(ge=0, le=3_600_000)]

# Every duration (and rate) in the spec declares its clock (docs/config.md, "Clocks"); the time
# scale k (`shared.config.timescale.scale_spec`) reads these marks, so no field is stretched by a list
# kept elsewhere, and a test refuses a duration without one.
#: Device time: what the emulated hardware takes, and margins sized against its bubbles. At a time
#: scale k it lasts k times as long in real time.
DEVICE = Meta(extra={"clock": "device"})
#: A rate per unit of device time (a link's bandwidth): at a time scale k it is k times lower.
DEVICE_RATE = Meta(extra={"clock": "device-rate"})
#: Host time: this machine's own waits (processes, sockets, clients, memory). Never stretched.
HOST = Meta(extra={"clock": "host"})


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The base of every section: immutable, and a misspelt key is an error rather than a silently ignored value."""
