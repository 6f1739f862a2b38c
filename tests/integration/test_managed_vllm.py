"""The vLLM `bubbletea up --decode vllm` starts itself: at the front door's niceness (it serves beside
training, and yields the CPU to it as the front door does) and dying with its launcher. A stand-in
interpreter says what it was started with; the real vLLM tier (tests/vllm) needs `make vllm`."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from bubbletea.launcher.procs import ServiceFailed
from bubbletea.launcher.services import PREFILL_QUEUE
from bubbletea.launcher.vllm import managed_vllm
from shared.config.spec import parse_spec
from tests.e2e.serving import SPEC

#: Says its niceness and its parent-death signal (prctl PR_GET_PDEATHSIG), then fails to load.
STAND_IN = """#!{python}
import ctypes, os
sig = ctypes.c_int(0)
ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(sig))
print("nice", os.nice(0), "pdeathsig", sig.value, flush=True)
raise SystemExit(3)
"""


async def test_the_vllm_up_starts_yields_to_training_and_dies_with_up(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = parse_spec({**SPEC, "prefill": {**SPEC["prefill"], "checkpoint": str(model)}})
    python = tmp_path / "python"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(0o755)
    log = tmp_path / "vllm.log"
    with pytest.raises(ServiceFailed, match="vllm exited with 3"):
        async with managed_vllm(spec, python, log, lambda _line: None):
            pass
    assert f"nice {PREFILL_QUEUE.nice} pdeathsig {int(signal.SIGTERM)}" in log.read_text()
