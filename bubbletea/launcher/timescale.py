"""The device time scale of a launcher's run (`shared.timescale`): the user's, or measured here."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from shared.settings import Settings
from shared.timescale import calibrate


async def pick_time_scale(settings: Settings, say: Callable[[str], None]) -> float:
    """`BUBBLETEA_TIME_SCALE` when the user set it; otherwise measured on this machine (a profile it
    cannot keep raises `ConfigError`, naming the operation). Exported to this process's environment,
    which every service it starts inherits, and said in one line."""
    if os.environ.get("BUBBLETEA_TIME_SCALE"):
        say(f"==> device time scale {settings.time_scale:g} (BUBBLETEA_TIME_SCALE)")
        return settings.time_scale
    cal = await asyncio.to_thread(calibrate, settings.spec)
    os.environ["BUBBLETEA_TIME_SCALE"] = f"{cal.scale:g}"
    say(f"==> {cal.line()}")
    return cal.scale
