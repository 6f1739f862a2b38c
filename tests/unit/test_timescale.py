"""The device time scale (`shared.config.timescale`): the smallest scale that keeps every operation's real
cost within its share of the profiled time, a profile the machine cannot keep refused naming the
operation, and the spec scaled consistently (device and WAN slower together)."""

import time

import msgspec
import pytest

from shared.config.settings import DEFAULT_SPEC, load_settings
from shared.config.spec import ConfigError, LinkOverride, load_spec
from shared.config.timescale import SHARE, WARN_SCALE, OpCost, choose_scale, profile_ms, scale_spec
from shared.model.calibration import WINDOW_S, _repeat
from shared.policies.pipeline_plan import predict


def test_the_scale_keeps_the_worst_operation_within_its_share() -> None:
    ops = [OpCost("train", 1.0, 60.0), OpCost("prefill block", 0.34, 1.27)]
    cal = choose_scale(ops, processes=4, share=0.1)
    assert cal.scale == pytest.approx(2.7)  # 0.34 / 1.27 / 0.1 = 2.68, rounded up to a tenth
    assert all(o.real_ms <= 0.1 * o.profiled_ms * cal.scale for o in ops)
    assert "prefill block" in cal.why and "device time scale 2.7" in cal.line()
    default = choose_scale(ops, processes=4)
    assert all(o.real_ms <= SHARE * o.profiled_ms * default.scale for o in ops)


def test_an_operation_costs_its_wall_time_over_the_window_waits_included() -> None:
    """The measured cost is the window over the repetitions, not one repetition's time: time an
    operation spends off the CPU (here asleep; under contention, waiting for a core) counts."""
    started = time.time()
    cost = _repeat(lambda: time.sleep(0.004), started)
    assert 4.0 <= cost < 8.0
    assert time.time() - started >= WINDOW_S


def test_a_machine_fast_enough_keeps_scale_one_and_no_profile_needs_none() -> None:
    assert choose_scale([OpCost("train", 1.0, 60.0)], processes=4).scale == 1.0
    assert choose_scale([], processes=4).scale == 1.0


def test_a_slow_machine_runs_at_the_scale_it_needs_and_warns_naming_the_cost() -> None:
    cal = choose_scale([OpCost("a prefill block (128 tokens)", 5.0, 1.0)], processes=4)
    assert cal.scale == pytest.approx(5.0 / SHARE, abs=0.1) and cal.scale > WARN_SCALE
    assert cal.warning is not None
    assert "a prefill block (128 tokens)" in cal.warning and "5.0x its profiled 1.00 ms" in cal.warning
    assert choose_scale([OpCost("train", 1.0, 1.0)], processes=4).warning is None  # 6.7: no warning


def test_a_cap_the_user_set_is_refused_naming_the_operation() -> None:
    with pytest.raises(ConfigError) as exc:
        choose_scale([OpCost("a prefill block (128 tokens)", 5.0, 1.0)], processes=4, max_scale=20)
    msg = str(exc.value)
    assert "--max-time-scale 20" in msg and "a prefill block (128 tokens)" in msg and "5.0x" in msg


def test_the_spec_is_scaled_device_and_wan_together() -> None:
    spec = load_spec(DEFAULT_SPEC)
    k = 3.0
    scaled = scale_spec(spec, k)
    d, s = spec.device, scaled.device
    assert s.fwd_ms_per_layer == pytest.approx(d.fwd_ms_per_layer * k)
    assert (s.allreduce_ms, s.step_ms) == (pytest.approx(d.allreduce_ms * k), pytest.approx(d.step_ms * k))
    assert s.prefill_ms_per_layer == pytest.approx(d.prefill_ms_per_layer * k)
    assert scaled.wan.default.latency_ms == pytest.approx(spec.wan.default.latency_ms * k)
    assert scaled.wan.default.bandwidth_gbps == pytest.approx(spec.wan.default.bandwidth_gbps / k)
    # the margins sized against bubbles keep their share of a bubble (docs/config.md, "Clocks")
    assert scaled.bubbletea.guard_ms == pytest.approx(spec.bubbletea.guard_ms * k)
    assert scaled.prefill.request_timeout_s == pytest.approx(spec.prefill.request_timeout_s * k)
    assert scaled.bus == spec.bus  # host time: never stretched
    assert scaled.bubbletea.stage_ms == pytest.approx(spec.bubbletea.stage_ms * k)
    # a worker keeps staged work across the gaps between its bubbles, which stretch with the device
    assert scaled.bubbletea.hold_ms == pytest.approx(spec.bubbletea.hold_ms * k)
    # the whole emulated iteration is k times longer: every ratio the benchmarks report is unchanged
    base = predict(spec, *profile_ms(spec), iterations=3).iteration_times[-1]  # type: ignore[misc]
    slow = predict(scaled, *profile_ms(scaled), iterations=3).iteration_times[-1]  # type: ignore[misc]
    assert slow == pytest.approx(base * k, rel=1e-9)
    assert scale_spec(spec, 1.0) is spec


def test_link_overrides_are_scaled_where_set() -> None:
    spec = load_spec(DEFAULT_SPEC)
    o = LinkOverride(src=spec.datacenters[0].name, dst=spec.datacenters[1].name, latency_ms=10.0)
    spec = msgspec.structs.replace(spec, wan=msgspec.structs.replace(spec.wan, links=(o,)))
    (got,) = scale_spec(spec, 2.0).wan.links
    assert got.latency_ms == 20.0 and got.bandwidth_gbps is None


def test_the_environment_sets_the_scale_and_the_launchers_keep_the_unscaled_spec() -> None:
    s = load_settings(env={"BUBBLETEA_TIME_SCALE": "2.5"})
    assert s.time_scale == 2.5 and s.base_spec is not None
    assert s.spec.device.fwd_ms_per_layer == pytest.approx(s.base_spec.device.fwd_ms_per_layer * 2.5)
    assert load_settings(env={}).time_scale == 1.0
    for bad in ("0.5", "x", "5000", "nan"):
        with pytest.raises(ConfigError, match="BUBBLETEA_TIME_SCALE: expected a number from 1 to"):
            load_settings(env={"BUBBLETEA_TIME_SCALE": bad})
