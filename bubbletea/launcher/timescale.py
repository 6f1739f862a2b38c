"""The device time scale of a launcher's run (`shared.config.timescale`): the user's, or measured here."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable

from bubbletea.progress import ClockBar
from shared.config.settings import Settings
from shared.config.spec import ClusterSpec, ConfigError
from shared.model.calibration import WINDOW_S, calibrate

#: Seconds one measuring process takes to start (spawn, import torch, build its models) with a core
#: to itself: `demo.yaml`'s four processes took 28 s on two busy cores.
START_S_PER_PROCESS = 12.0


def estimate_s(spec: ClusterSpec, cores: int | None = None) -> float:
    """About how long `calibrate` takes here, for the bar: its processes' start, shared among the
    cores, and the two measuring windows."""
    processes = spec.parallelism.pp * spec.parallelism.dp
    return START_S_PER_PROCESS * processes / max(1, cores or os.cpu_count() or 1) + 2 * WINDOW_S


async def pick_time_scale(settings: Settings, say: Callable[[str], None]) -> float:
    """`BUBBLETEA_TIME_SCALE` when the user set it; otherwise measured on this machine: the scale it
    needs, with one warning line naming the cost above `WARN_SCALE` (`ConfigError`, naming the
    operation, only past a cap the user set: `settings.max_time_scale`). Exported to this process's
    environment, which every service it starts inherits, and said in one line. On a terminal, a bar
    shows the measurement's progress against an estimate of its length (`estimate_s`)."""
    if os.environ.get("BUBBLETEA_TIME_SCALE"):
        say(f"==> device time scale {settings.time_scale:g} (BUBBLETEA_TIME_SCALE)")
        return settings.time_scale
    try:
        with ClockBar(estimate_s(settings.spec), "measuring this machine", sys.stdout) as bar:
            cal = await bar.run(asyncio.to_thread(calibrate, settings.spec, None, settings.max_time_scale))
    except ConfigError:
        raise  # past the user's cap: refused, saying why
    except Exception as exc:  # the measurement itself failed (e.g. a checkpoint that does not load)
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        os.environ["BUBBLETEA_TIME_SCALE"] = "1"
        say(f"==> device time scale 1: could not measure this machine ({why}); the services will say more")
        return 1.0
    os.environ["BUBBLETEA_TIME_SCALE"] = f"{cal.scale:g}"
    say(f"==> {cal.line()}")
    if cal.warning:
        say(f"==> warning: {cal.warning}")
    return cal.scale
