"""Fault injection for the guest model: make a worker's prefill fail, to see training go on.

`BUBBLETEA_CHAOS_PREFILL` (`Settings.chaos_prefill`; unset in normal runs) makes the
worker's prefill model fail for real after a number of blocks ran:

* ``raise-after:N``: every block after the first N raises a `RuntimeError` (a broken model);
* ``oom-after:N``: every block after the first N asks the device for more memory than it has (a
  petabyte), so the device's allocator itself fails: `torch.OutOfMemoryError` on CUDA, the CPU
  allocator's `RuntimeError` elsewhere.

``raise`` and ``oom`` are the same with N = 0. It is for the failure tests (tests/e2e/
test_guest_failure.py, tests/e2e/test_cuda.py) and for trying the behaviour by hand: the worker's
fill executor fails the request, hands the rest of its batch back and trains on, and after a few
failed batches in a row takes no more prefill (services/stage_worker/fill/executor.py).
"""

from __future__ import annotations

from typing import Any

import torch

from shared.model.prefill import PrefillModel, PrefillState

ENV = "BUBBLETEA_CHAOS_PREFILL"  # read and checked by `shared.config.settings` (`Settings.chaos_prefill`)
#: What `oom` asks the device for: more than any has.
OOM_BYTES = 1 << 50


def failing(model: PrefillModel, setting: str) -> PrefillModel:
    """`model`, failing as `setting` (a checked `BUBBLETEA_CHAOS_PREFILL` value) says: its
    `run_layers` replaced on this object only."""
    mode, _, after_s = setting.partition("-after:")
    after = int(after_s or 0)
    run_layers = model.run_layers
    ran = [0]

    def run_or_fail(state: PrefillState, *args: Any, **kw: Any) -> PrefillState:
        ran[0] += 1
        if ran[0] > after:
            if mode == "oom":
                torch.empty(OOM_BYTES, dtype=torch.uint8, device=model.device)  # the allocator fails
            raise RuntimeError(f"{ENV}={setting}: prefill block {ran[0]} fails on purpose")
        return run_layers(state, *args, **kw)

    model.run_layers = run_or_fail  # type: ignore[method-assign]
    return model
