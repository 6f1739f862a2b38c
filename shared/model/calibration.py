"""The device time scale, measured: what the profiled operations' real compute costs on this
machine with every worker computing at once (`measure`), and the scale that keeps it within the
profile (`calibrate`; the pure rule, `choose_scale`, and applying a scale, `scale_spec`, are in
`shared.config.timescale`, whose docstring says why a scale).

A run's launcher calls `calibrate` before it starts its workers (bubbletea/launcher/timescale.py);
the benchmarks do the same per case. The measuring runs torch, in processes of their own.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from multiprocessing.synchronize import Barrier

from shared.config.spec import ClusterSpec
from shared.config.timescale import Calibration, OpCost, choose_scale, profile_ms

#: A prompt of this many tokens stands for a prefill block (the benchmark's load: ~96 tokens).
PREFILL_TOKENS = 128
#: Each operation is repeated this long by every process at once (and at least `MIN_REPS` times).
WINDOW_S = 0.5
MIN_REPS = 5

_barrier: Barrier | None = None  # in a measuring process: every process built its models


def _join(barrier: Barrier) -> None:
    global _barrier
    _barrier = barrier


def _time_ops(spec: ClusterSpec) -> dict[str, float]:
    """In one process: the real ms of each profiled operation. Every process repeats each
    operation for the same `WINDOW_S`, starting together once all have built their models, so
    they compete for the cores the whole time as the workers will (a handful of repetitions each
    was too short to overlap: the chosen scale swung between 2.7 and 8.1 from one measurement to
    the next)."""
    import torch

    from shared.model.gpt import build_stage  # torch: in the measuring process only
    from shared.model.prefill import PrefillModel
    from shared.model.shape import GPTConfig

    torch.set_num_threads(1)  # as a worker runs
    out: dict[str, float] = {}
    stages = spec.parallelism.pp
    model = build_stage(GPTConfig.from_spec(spec.model), spec.model.seed, 1 if stages > 1 else 0, stages)
    x = torch.randn(spec.training.microbatch_size, spec.model.seq_len, spec.model.d_model)
    prefill = PrefillModel.from_spec(spec.prefill) if spec.bubbletea.enabled else None
    n = min(len_tokens(spec), prefill.max_tokens) if prefill is not None else 0
    tokens = [i % 200 + 1 for i in range(n)]

    def train() -> None:
        model(x.clone().requires_grad_(True)).float().sum().backward()

    train()  # warm-up, before the common start
    if prefill is not None:
        prefill.prefill(tokens)
    assert _barrier is not None, "measure() starts the processes with the barrier"
    _barrier.wait(timeout=120)
    at = time.time()
    if profile_ms(spec) is not None:
        out["train"] = _repeat(train, at)
        at += WINDOW_S
    if prefill is not None and _prefill_profiled(spec):
        out["prefill"] = _repeat(lambda: prefill.prefill(tokens), at) / prefill.layers
        out["prefill_tokens"] = n
    return out


def _repeat(op: Callable[[], object], start_at: float) -> float:
    """`op`'s cost in wall ms, repeated from `start_at` for `WINDOW_S` (at least `MIN_REPS` times):
    the window over the repetitions, so time spent waiting for a core counts. (The median of single
    repetitions did not: an operation shorter than the scheduler's slice is seldom preempted, and
    the figure swung between the unshared cost and twice it from one measurement to the next.)"""
    time.sleep(max(0.0, start_at - time.time()))
    t0, reps = time.perf_counter(), 0
    while reps < MIN_REPS or time.time() < start_at + WINDOW_S:
        op()
        reps += 1
    return (time.perf_counter() - t0) * 1000 / reps


def measure(spec: ClusterSpec, processes: int) -> list[OpCost]:
    """The profiled operations' real cost here with `processes` computing at once: a forward and
    backward of one stage on one microbatch (a middle stage: no embedding or loss), and one
    prefill block of a `PREFILL_TOKENS`-token prompt."""
    prof = profile_ms(spec)
    ctx = get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=ctx, initializer=_join, initargs=(ctx.Barrier(processes),)) as pool:
        results = list(pool.map(_time_ops, [spec] * processes))
    ops = []
    if prof is not None:
        layers = max(1, spec.model.layers // spec.parallelism.pp)
        real = statistics.median(r["train"] for r in results)
        ops.append(OpCost("a stage's forward + backward", real, (prof[0] + prof[1]) * layers))
    if results and "prefill" in results[0]:
        dev, n = spec.device, int(results[0]["prefill_tokens"])
        profiled = (dev.prefill_ms_per_layer or 0.0) + (dev.prefill_us_per_token or 0.0) * n / 1000
        ops.append(
            OpCost(
                f"a prefill block ({n} tokens)",
                statistics.median(r["prefill"] for r in results),
                profiled,
            )
        )
    return ops


def _prefill_profiled(spec: ClusterSpec) -> bool:
    return spec.device.prefill_ms_per_layer is not None or spec.device.prefill_us_per_token is not None


def len_tokens(spec: ClusterSpec) -> int:
    return min(PREFILL_TOKENS, spec.prefill.max_prompt_tokens)


def calibrate(spec: ClusterSpec, processes: int | None = None, max_scale: float | None = None) -> Calibration:
    """Measure and choose (a run's launcher calls this before starting its workers)."""
    n = processes or spec.parallelism.pp * spec.parallelism.dp
    if profile_ms(spec) is None and not (spec.bubbletea.enabled and _prefill_profiled(spec)):
        return choose_scale([], n)  # nothing pads: nothing to keep
    return choose_scale(measure(spec, max(1, min(n, 2 * (os.cpu_count() or 1)))), n, max_scale=max_scale)
