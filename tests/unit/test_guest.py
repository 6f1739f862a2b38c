"""A failing guest: when a worker stops taking prefill, and what the dispatcher and the readiness
gate do once it says so."""

from __future__ import annotations

import pytest

from shared.config.settings import load_settings
from shared.config.spec import ConfigError
from shared.policies.dispatch_inputs import Progress
from shared.policies.guest import MAX_FAILURES, GuestHealth
from shared.policies.readiness import ServingGate, SlotView
from shared.wire.status import ServingState
from tests.unit.test_dispatch import end, join, one, req, start, state


def test_a_worker_stops_taking_prefill_after_failed_batches_in_a_row_and_a_good_one_resets_the_count() -> None:
    h = GuestHealth()
    for _ in range(MAX_FAILURES - 1):
        v = h.failed("RuntimeError: boom")
        assert v.take and "RuntimeError: boom" in v.why
    assert h.ran().take and h.in_a_row == 0  # one that ran without error: a fresh count
    for _ in range(MAX_FAILURES - 1):
        assert h.failed("RuntimeError: boom").take
    v = h.failed("OutOfMemoryError: CUDA out of memory")
    assert not v.take and not h.taking
    assert f"{MAX_FAILURES} batches in a row" in v.why and "OutOfMemoryError" in v.why and "trains on" in v.why
    assert not h.ran().take and h.failures == 2 * MAX_FAILURES - 1  # it does not come back by itself


def test_the_dispatcher_sends_a_worker_off_prefill_nothing_until_a_new_process_joins() -> None:
    s = state()
    join(s, "w1", 0.040, now=0.0)
    join(s, "w2", 0.040, now=0.0)
    b = one(s.add_request(req(0, 10), now=0.0))
    off = b.worker
    on = "w2" if off == "w1" else "w1"
    s.worker_off(off, "prefill failed in 3 batches in a row", now=0.1)
    assert s.workers[off].off is not None
    for i in range(1, 8):  # whatever arrives, whatever bubbles it has: the other worker takes it
        start(s, off, 0.05, now=0.1 + i)
        ds = s.add_request(req(i, 10), now=0.1 + i)
        assert all(x.worker == on for x in ds.batches)
        end(s, off, 0.05, now=0.1 + i)
    # the batch it held comes back handed back, unstarted: queued again for the other
    ds = s.report(b.batch_id, off, [Progress("r0", 0, 0.0, False)], now=9.0)
    assert s.requests["r0"].on_worker in (None, on)
    assert all(x.worker == on for x in ds.batches)
    join(s, off, 0.040, now=10.0)  # a new process in its slot: its guest starts afresh
    assert s.workers[off].off is None
    assert any(x.worker == off for x in s.add_request(req(20, 10), now=10.0).batches)


def test_ready_names_workers_off_prefill_and_says_when_none_takes_it() -> None:
    g = ServingGate(run="r1", enabled=True, unready_after_s=10.0)
    held = [SlotView("r0s0", True), SlotView("r0s1", True)]
    assert g.assess(held, now=0.0).state is ServingState.SERVING
    g.prefill_off("r0s1", "prefill failed in 3 batches in a row (the last: RuntimeError: boom)")
    v = g.assess(held, now=1.0)
    assert v.ready and "1 of them take no prefill (r0s1: prefill failed in 3 batches" in v.reason
    g.prefill_off("r0s0", "prefill failed in 3 batches in a row (the last: OutOfMemoryError)")
    v = g.assess(held, now=2.0)
    assert v.state is ServingState.PREFILL_FAILED and not v.ready and v.fail_queued
    assert "trains on, but every worker stopped taking prefill" in v.reason and v.retry_after_s == 60
    g.prefill_on("r0s0")  # replaced: serving again
    assert g.assess(held, now=3.0).ready


def test_the_fault_injection_setting_is_checked_at_start_saying_what_is_accepted() -> None:
    assert load_settings(env={"BUBBLETEA_CHAOS_PREFILL": "oom-after:12"}).chaos_prefill == "oom-after:12"
    assert load_settings(env={}).chaos_prefill is None
    with pytest.raises(ConfigError, match="expected raise, oom, raise-after:N or oom-after:N"):
        load_settings(env={"BUBBLETEA_CHAOS_PREFILL": "explode"})
