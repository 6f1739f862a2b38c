"""The GPU check's simulator fit (bench/_sim_fit.py): the device's times learned from a live pair's
records, so the simulator can run a spec that has no device profile."""

from __future__ import annotations

import time

import pytest

from bench import _sim_fit
from shared.config.spec import parse_spec
from shared.policies.spans import Span
from shared.wire import PrefillProgress, PrefillReport, PrefillRequest
from shared.wire.status import ItemOutcome

SPEC = parse_spec(
    {
        "datacenters": [{"name": "a", "gpus": 2}],
        "model": {"layers": 6, "d_model": 16, "heads": 2, "seq_len": 8},
        "parallelism": {"pp": 2, "dp": 1, "split": "layers"},
    }
)


def _request(i: int, tokens: int) -> PrefillRequest:
    return PrefillRequest(id=f"r{i}", model="m", tokens=tuple(range(tokens)), submitted=time.time(), reply_to="x")


def _report(*progress: PrefillProgress) -> PrefillReport:
    return PrefillReport(run="r", worker="r0s0", batch_id="b", progress=progress, preempted=False, at=0.0)


def test_prefill_times_are_fitted_per_piece_from_fresh_requests_run_whole() -> None:
    """seconds a layer = 0.2 ms a piece (of 100 tokens) + 3 us a token, recovered exactly; a
    request's second report (resumed), one not done, and one resumed from a layer are left out."""
    layers, lengths = 4, [40, 100, 150, 260, 380]

    def secs(n: int) -> float:
        return layers * (0.0002 * -(-n // 100) + 3e-6 * n)

    done = [PrefillProgress(id=f"r{i}", outcome=ItemOutcome.DONE, reached_layer=layers, seconds=secs(n))
            for i, n in enumerate(lengths)]  # fmt: skip
    noise = [
        PrefillProgress(id="r0", outcome=ItemOutcome.DONE, reached_layer=layers, seconds=9.0),  # its second report
        PrefillProgress(id="r9", outcome=ItemOutcome.PARTIAL, reached_layer=2, seconds=9.0),
        PrefillProgress(id="r8", outcome=ItemOutcome.DONE, reached_layer=layers, seconds=9.0, started_layer=2),
    ]
    recorded = [*(_request(i, n) for i, n in enumerate(lengths)), _request(8, 50), _request(9, 50)]
    recorded += [_report(*done), _report(*noise)]
    fitted = _sim_fit.fit_prefill(recorded, layers, piece_tokens=100)
    assert fitted is not None
    assert fitted["prefill_ms_per_layer"] == pytest.approx(0.2, rel=1e-6)
    assert fitted["prefill_us_per_token"] == pytest.approx(3.0, rel=1e-6)
    # one prompt length is not enough to tell the fixed part from the per-token part
    assert _sim_fit.fit_prefill([_request(0, 40), _report(done[0])], layers, piece_tokens=100) is None


def test_training_times_are_fitted_per_stage_and_per_layer() -> None:
    spans = []
    for it in range(3):
        for stage, fwd in ((0, 0.003), (1, 0.005)):  # 3 layers a stage: the last has the head
            t = it * 1.0
            spans.append(Span(0, stage, it, "fwd", t, t + fwd, 0))
            spans.append(Span(0, stage, it, "bwd", t, t + 2 * fwd, 0))
            spans.append(Span(0, stage, it, "step", t, t + 0.001))
    assert _sim_fit.stage_seconds(SPEC, spans, "fwd") == pytest.approx((0.003, 0.005))
    fitted = _sim_fit.fit_training(SPEC, spans)
    assert fitted["fwd_ms_per_layer"] == pytest.approx(4 / 3)  # the median of 1 and 5/3 ms a layer
    assert fitted["step_ms"] == pytest.approx(1.0) and fitted["allreduce_ms"] == 0.0


def test_the_bus_hop_is_the_median_wait_for_a_tensor_from_the_same_datacenter() -> None:
    """Stage 1 waits for stage 0's forward (sent at its span's end, 1.0 s) and gets it at 1.002 s:
    a 2 ms hop; stage 0 waits for stage 1's backward, 3 ms; a hop across datacenters (stage 2 in
    another DC) and a wait not for a tensor (before the step) are left out."""
    spans = [
        Span(0, 0, 1, "fwd", 0.9, 1.0, 0),
        Span(0, 1, 1, "wait", 0.95, 1.002, 0, 10.0, 1.002),
        Span(0, 1, 1, "fwd", 1.002, 1.1, 0),
        Span(0, 2, 1, "wait", 1.05, 1.2, 0, 10.0, 1.15),  # from stage 1, across the WAN
        Span(0, 2, 1, "fwd", 1.2, 1.3, 0),
        Span(0, 1, 1, "bwd", 1.4, 1.5, 0),
        Span(0, 0, 1, "wait", 1.45, 1.503, 0, 10.0, 1.503),
        Span(0, 0, 1, "bwd", 1.503, 1.6, 0),
        Span(0, 0, 1, "wait", 1.6, 1.7, None, 10.0, 1.7),
        Span(0, 0, 1, "step", 1.7, 1.8),
    ]
    hop = _sim_fit.fit_bus_s(("a", "a", "b"), spans)
    assert hop == pytest.approx(0.0025)
    assert _sim_fit.fit_bus_s(("a", "b", "c"), spans) is None  # no tensor from its own DC
