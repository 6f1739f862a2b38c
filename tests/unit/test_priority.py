"""Compute below the control plane (`shared.priority`): a thread lowers only its own nice value,
and BUBBLETEA_COMPUTE_PRIORITY=normal leaves every thread at 0."""

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared import priority
from shared.settings import load_settings

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")


def test_a_pool_thread_runs_at_its_nice_value_and_the_caller_keeps_its_own() -> None:
    before = priority.thread_nice()
    with ThreadPoolExecutor(1, initializer=priority.lower_this_thread, initargs=(priority.PREFILL_NICE,)) as pool:
        assert pool.submit(priority.thread_nice).result() == max(before, priority.PREFILL_NICE)
    assert priority.thread_nice() == before  # per thread, not the process


def test_normal_priority_leaves_compute_at_zero() -> None:
    try:
        priority.configure(load_settings(env={"BUBBLETEA_COMPUTE_PRIORITY": "normal"}).compute_priority)
        assert (priority.train_nice(), priority.prefill_nice()) == (0, 0)
        priority.configure(load_settings(env={}).compute_priority)
        assert (priority.train_nice(), priority.prefill_nice()) == (priority.TRAIN_NICE, priority.PREFILL_NICE)
        assert priority.TRAIN_NICE < priority.PREFILL_NICE  # a guest's compute below the owner's
    finally:
        priority.configure("low")
    with pytest.raises(Exception, match="BUBBLETEA_COMPUTE_PRIORITY: expected low or normal"):
        load_settings(env={"BUBBLETEA_COMPUTE_PRIORITY": "high"})
