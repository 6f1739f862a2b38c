"""The device time scale of a launcher's run (`shared.timescale`): the user's, or measured here."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from shared.config import ConfigError
from shared.settings import Settings
from shared.timescale import calibrate


async def pick_time_scale(settings: Settings, say: Callable[[str], None]) -> float:
    """`BUBBLETEA_TIME_SCALE` when the user set it; otherwise measured on this machine (a profile it
    cannot keep raises `ConfigError`, naming the operation). Exported to this process's environment,
    which every service it starts inherits, and said in one line."""
    if os.environ.get("BUBBLETEA_TIME_SCALE"):
        say(f"==> device time scale {settings.time_scale:g} (BUBBLETEA_TIME_SCALE)")
        return settings.time_scale
    try:
        cal = await asyncio.to_thread(calibrate, settings.spec)
    except ConfigError:
        raise  # a profile this machine cannot keep: refused, saying why
    except Exception as exc:  # the measurement itself failed (e.g. a checkpoint that does not load)
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        os.environ["BUBBLETEA_TIME_SCALE"] = "1"
        say(f"==> device time scale 1: could not measure this machine ({why}); the services will say more")
        return 1.0
    os.environ["BUBBLETEA_TIME_SCALE"] = f"{cal.scale:g}"
    say(f"==> {cal.line()}")
    return cal.scale
