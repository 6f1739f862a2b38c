"""What bench/sim_vs_live.py compares must be the same on both sides: the requests the live front
door accepted (read off the real request stream), prompts the spec's front door takes, and one
prefill profile for both."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.sim_vs_live import Case, case_spec, load_input_len, main, watch_requests
from loadgen.datasets import length_range
from shared.bus import Bus
from shared.control import serving
from shared.wire import PrefillRequest, keys

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_prompts_fit_the_front_door_and_the_profile_is_scaled_on_both_sides() -> None:
    assert load_input_len(256) == 96  # the demo's load as it is
    hi = length_range(load_input_len(64), 0.5)[1]
    assert hi <= 64 < length_range(load_input_len(64) + 1, 0.5)[1]  # the longest load that fits
    raw = case_spec(Case(CONFIGS / "wan-bound.yaml", "fair", True), 6, prefill_scale=3.0)
    # wan-bound has no prefill profile: both sides get the simulator's default, times 3
    assert raw["device"]["prefill_ms_per_layer"] == pytest.approx(0.75)
    assert raw["device"]["prefill_us_per_token"] == pytest.approx(24.0)
    assert raw["wan"]["sharing"] == "fair" and raw["training"]["iterations"] == 6


async def test_the_accepted_requests_are_read_off_the_request_stream(redis_url: str) -> None:
    got: list[tuple[float, int]] = []
    watcher = asyncio.create_task(watch_requests(redis_url, keys.prefill_requests_stream("sim"), got))
    sent = []
    async with Bus(redis_url) as bus:
        async with asyncio.timeout(60):  # the watcher reads from "now on": send once it reads
            while not any(c.get("cmd") == "xread" for c in await bus.redis.client_list()):  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # another connection's state: no event to wait on
        for i, n in enumerate((5, 17, 3)):
            req = PrefillRequest(id=f"r{i}", model="m", tokens=tuple(range(n)), submitted=time.time(), reply_to="x")
            assert await serving.accept(bus.redis, "sim", req, 100)
            sent.append((req.submitted, n))
        async with asyncio.timeout(60):
            while len(got) < 3:  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # the watcher appends as it reads: no event to wait on
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert got == sent


@pytest.mark.parametrize("scale", ["0", "-1"])
def test_a_prefill_scale_that_is_not_positive_is_a_usage_error(scale: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--quick", "--prefill-scale", scale])
    assert e.value.code == 2
    assert f"--prefill-scale must be > 0, got {float(scale)}" in capsys.readouterr().err
