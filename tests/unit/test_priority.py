"""Compute below the control plane (`shared.runtime.priority`): a thread lowers only its own nice value
(and, for prefill, shortens its own EEVDF slice), and BUBBLETEA_COMPUTE_PRIORITY=normal leaves
every thread at 0 with the kernel's slice."""

import platform
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.config.settings import load_settings
from shared.runtime import priority

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")


def test_a_pool_thread_runs_at_its_nice_value_and_the_caller_keeps_its_own() -> None:
    before = priority.thread_nice()
    with ThreadPoolExecutor(1, initializer=priority.lower_this_thread, initargs=(priority.PREFILL_NICE,)) as pool:
        assert pool.submit(priority.thread_nice).result() == max(before, priority.PREFILL_NICE)
    assert priority.thread_nice() == before  # per thread, not the process


def _kernel() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@pytest.mark.skipif(sys.platform == "linux" and _kernel() < (6, 12), reason="custom EEVDF slices need Linux 6.12")
def test_the_prefill_thread_asks_for_a_short_slice_at_its_nice_value() -> None:
    default = priority.thread_slice_us()
    assert default > priority.PREFILL_SLICE_US  # else asking would change nothing
    args = (priority.PREFILL_NICE, priority.PREFILL_SLICE_US)
    with ThreadPoolExecutor(1, initializer=priority.lower_this_thread, initargs=args) as pool:
        got = pool.submit(lambda: (priority.thread_nice(), priority.thread_slice_us())).result()
    assert got == (max(priority.thread_nice(), priority.PREFILL_NICE), priority.PREFILL_SLICE_US)
    assert priority.thread_slice_us() == default  # the caller keeps its own


def test_normal_priority_leaves_compute_at_zero() -> None:
    try:
        priority.configure(load_settings(env={"BUBBLETEA_COMPUTE_PRIORITY": "normal"}).compute_priority)
        assert (priority.train_nice(), priority.prefill_nice(), priority.prefill_slice_us()) == (0, 0, 0)
        priority.configure(load_settings(env={}).compute_priority)
        assert priority.prefill_slice_us() == priority.PREFILL_SLICE_US
        assert (priority.train_nice(), priority.prefill_nice()) == (priority.TRAIN_NICE, priority.PREFILL_NICE)
        assert priority.TRAIN_NICE < priority.PREFILL_NICE  # a guest's compute below the owner's
    finally:
        priority.configure("low")
    with pytest.raises(Exception, match="BUBBLETEA_COMPUTE_PRIORITY: expected low or normal"):
        load_settings(env={"BUBBLETEA_COMPUTE_PRIORITY": "high"})


def test_without_sched_setattr_the_prefill_thread_still_gets_its_nice_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "_SYSCALLS", (-1, -1))  # as on a machine whose syscall numbers we do not know
    monkeypatch.setattr(priority, "_warned", False)
    args = (priority.PREFILL_NICE, priority.PREFILL_SLICE_US)
    with ThreadPoolExecutor(1, initializer=priority.lower_this_thread, initargs=args) as pool:
        assert pool.submit(priority.thread_nice).result() == max(priority.thread_nice(), priority.PREFILL_NICE)
    assert priority._warned  # said once in the log
