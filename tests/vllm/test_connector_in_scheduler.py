"""BubbleTea's vLLM connector inside a real vLLM scheduler, in one process, in seconds (docs/vllm.md).

vLLM imports only in its own environment, so `drive_connector.py` runs there, under vLLM's python,
every scenario in one process (importing vLLM is most of its time). The KV holder it loads from is
this process's: a real `KvServer` holding caches made as a stage worker makes them (`kv_file`),
beside a holder that accepts connections and never answers (frozen) and an address where nothing
listens (gone). Each test below is one scenario's outcome; the last checks what the holders saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.lib.vllm_stack import vllm_python
from shared.dataplane.kv import KvServer, KvShelf
from shared.dataplane.kvstore import kv_file

pytestmark = [pytest.mark.timeout(300)]

DRIVER = Path(__file__).with_name("drive_connector.py")
#: The driver's model: 2 layers of 2 KV heads of 64 dimensions; BubbleTea's first token.
LAYERS, KV_HEADS, HEAD_DIM, FIRST = 2, 2, 64, 7
#: Cache name -> prompt length (the key is the name: distinct per scenario).
CACHES = {"new": 70, "preempted": 40, "beside": 33}
#: Named in the driver's handles but never put on the holder: expired or freed, for vLLM the same.
MISSING = ("missing", "frozen", "gone", "aborted")
SCENARIOS = [
    "a_new_request_waits_for_its_load_then_computes_only_the_first_token",
    "a_preempted_request_loads_its_cache_again_when_resumed",
    "a_frozen_holder_holds_up_only_its_own_loads",
    "a_load_error_fails_the_request_under_policy_fail",
    "a_load_error_recomputes_the_prompt_under_policy_recompute",
    "a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends",
    "a_handle_without_a_cache_has_vllm_compute_the_prompt",
]


class Holder:
    """A stage worker's KV holder (`KvServer`) on an event loop of its own thread."""

    def __init__(self, shelf: KvShelf) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = KvServer(shelf, "127.0.0.1")
        self.thread = threading.Thread(target=self.loop.run_forever, name="kv-holder", daemon=True)
        self.thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def a_cache(key: str, n: int, rng: random.Random) -> tuple[list[int], bytes]:
    prompt = [rng.randrange(1, 1000) for _ in range(n)]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    kv = [(torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=g), torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=g))
          for _ in range(LAYERS)]  # fmt: skip
    return prompt, kv_file(key, "tiny", prompt, FIRST, kv)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Holder, str]]:
    """The driver's report, the holder, and the driver's output (vLLM's log lines among it)."""
    python = vllm_python()
    assert python is not None  # the conftest skips the tier without it
    workdir = tmp_path_factory.mktemp("connector")
    rng = random.Random(50)
    shelf = KvShelf(ttl_s=600, budget_bytes=1 << 30)
    caches: dict[str, dict[str, Any]] = {}
    for name, n in CACHES.items():
        prompt, data = a_cache(name, n, rng)
        shelf.put(name, data, time.time())
        caches[name] = {"key": name, "prompt": prompt}
    for name in MISSING:
        caches[name] = {"key": name, "prompt": [rng.randrange(1, 1000) for _ in range(36)]}
    holder = Holder(shelf)
    frozen = socket.create_server(("127.0.0.1", 0))  # listens, never accepts: connects, never answers
    with socket.create_server(("127.0.0.1", 0)) as s:
        gone = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    spec = {
        "workdir": str(workdir), "holder": holder.address, "frozen": f"127.0.0.1:{frozen.getsockname()[1]}",
        "gone": gone, "caches": caches,
    }  # fmt: skip
    (workdir / "spec.json").write_text(json.dumps(spec))
    try:
        done = subprocess.run(
            [str(python), str(DRIVER), str(workdir / "spec.json"), str(workdir / "report.json")],
            capture_output=True, text=True, timeout=240, cwd=workdir,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG", "NO_COLOR": "1"},
        )  # fmt: skip
        output = done.stdout + done.stderr
        (workdir / "driver.log").write_text(output)
        assert done.returncode == 0, output[-4000:]
        yield json.loads((workdir / "report.json").read_text()), holder, output
    finally:
        frozen.close()
        holder.close()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(run: tuple[dict[str, Any], Holder, str], scenario: str) -> None:
    report, _, _ = run
    outcome = report.get(scenario)
    assert outcome is not None, f"the driver did not run {scenario}: it ran {list(report)}"
    assert outcome["ok"], outcome["error"]


def test_the_driver_ran_every_scenario_in_seconds(run: tuple[dict[str, Any], Holder, str]) -> None:
    report, _, _ = run
    assert sorted(report) == sorted(SCENARIOS)
    assert all(o["seconds"] < 30 for o in report.values()), {k: o["seconds"] for k, o in report.items()}


def test_the_connector_logs_on_vllms_log_at_vllms_level(run: tuple[dict[str, Any], Holder, str]) -> None:
    """Its logger is one of vLLM's ("vllm.bubbletea_vllm..."): vLLM's format, and VLLM_LOGGING_LEVEL
    (DEBUG here) lets its debug lines through."""
    _, _, output = run
    stamp = r"\d\d-\d\d \d\d:\d\d:\d\d"
    failed = rf"ERROR {stamp} \[worker\.py:\d+\] request missing: the BubbleTea KV cache was not loaded: no KV cache"
    assert re.search(failed, output), output[-3000:]
    assert re.search(rf"DEBUG {stamp} \[worker\.py:\d+\] request new: loaded positions 0\.\.70 from ", output)


def test_the_holder_freed_every_cache_once_its_request_finished(run: tuple[dict[str, Any], Holder, str]) -> None:
    _, holder, _ = run
    assert not holder.server.shelf.held, f"still held: {list(holder.server.shelf.held)}"
    assert holder.server.freed == len(CACHES)
