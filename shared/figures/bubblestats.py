"""The per-bubble figures of a run: every bubble counted, filled or not, and the control plane's
latency on the clock of the device it stands for.

A bubble is a worker's `wait` span (`runstats.bubble_end`: it ends when the awaited input arrives).
The dispatcher records, for each bubble start it handles, whether work was waiting for that
worker as it opened (requests queued, or a batch staged there), and, for each batch report, when
the worker sent it (`ControlSeen`, on the run's spans stream). From those:

* **dispatch latency** (`BubbleDispatch.latencies_ms`): one value per bubble that opened with work:
  its start to its first prefill running (host time, as it is), or, if no prefill ran in it, its
  whole length in device time (real / k: its length at k = 1, where the host's latency would be the
  same and the bubble k times shorter). A bubble that opened with nothing waiting is counted in
  `total` only: there was nothing to dispatch. `total`, `with_work` and `filled` (a prefill ran in
  it) are reported beside the percentiles, and `real_latencies_ms` keeps every value in real ms.
* **control share**: a host-side latency (bubble start on the worker to prefill running on it, in a
  bubble with work that was filled; a batch report sent to the dispatcher handling it) over the
  mean bubble in device time: the share of a bubble it would take at time scale k = 1, since the
  host's latencies do not stretch with k (docs/config.md, "Clocks").
* **capacity**: the prompts (`capacity_requests_per_s`), or prompt tokens (`capacity_tokens_per_s`),
  per second a run's bubbles can hold, from a run without BubbleTea: what an offered load is a
  share of.
* **prediction error**, **overrun**: per bubble, |actual - predicted| length; input arrived to
  training resumed where prefill ran in it.

Latencies are real (host) milliseconds; bubble lengths are real milliseconds of a run at scale k.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.figures.runstats import bubble_end, full_window, read_stream, steady, utilization
from shared.policies.fill import usable_s
from shared.policies.spans import Span
from shared.wire import ControlSeen, keys
from shared.wire.status import ControlEvent

if TYPE_CHECKING:
    from redis.asyncio import Redis


async def run_control(r: Redis, run: str) -> list[ControlSeen]:
    """Every `ControlSeen` the run's dispatcher recorded."""
    return [m for m in await read_stream(r, keys.spans_stream(run)) if isinstance(m, ControlSeen)]


@dataclass(frozen=True)
class BubbleDispatch:
    """Every bubble of a run, and how soon prefill ran in those that opened with work."""

    total: int
    with_work: int
    filled: int  # bubbles with a prefill running in them (with work or not: staged work can run)
    #: per bubble with work: start to its first prefill running (host ms), else its whole length
    #: in device ms (real ms / k)
    latencies_ms: tuple[float, ...]
    #: per bubble with work that was filled: start to its first prefill running (host ms)
    filled_latencies_ms: tuple[float, ...]
    #: as `latencies_ms`, an empty bubble's whole length in real ms (the same at k = 1)
    real_latencies_ms: tuple[float, ...] = ()


def bubble_dispatch(spans: Iterable[Span], seen: Iterable[ControlSeen], time_scale: float = 1.0) -> BubbleDispatch:
    """The dispatch figures over every `wait` span in `spans` of a run at `time_scale`. A bubble the
    dispatcher left no record of (its start was never handled) counts as one with work: unknown is
    not a pass."""
    opened = {(c.worker, c.at): c.with_work for c in seen if c.event is ControlEvent.BUBBLE_START}
    prefills = _prefills_by_worker(spans)
    total = with_work = filled = 0
    latencies, filled_latencies, real = [], [], []
    for w in (s for s in spans if s.kind == "wait"):
        total += 1
        first = next((p.start for p in prefills.get(w.worker, ()) if w.start <= p.start <= w.end), None)
        filled += first is not None
        if not opened.get((w.worker, w.start), True):
            continue
        with_work += 1
        if first is None:
            real.append((bubble_end(w) - w.start) * 1000)
            latencies.append(real[-1] / time_scale)
        else:
            real.append((first - w.start) * 1000)
            latencies.append(real[-1])
            filled_latencies.append(real[-1])
    return BubbleDispatch(total, with_work, filled, tuple(latencies), tuple(filled_latencies), tuple(real))


def empty_with_work(spans: Iterable[Span], seen: Iterable[ControlSeen]) -> list[dict[str, object]]:
    """Every bubble that opened with work and had no prefill running in it (the bubbles counted in
    `with_work` and not in `filled`), with its predicted and actual length (real ms): what
    `--dump` lists, to see whether such bubbles were short, mispredicted or late."""
    opened = {(c.worker, c.at): c.with_work for c in seen if c.event is ControlEvent.BUBBLE_START}
    prefills = _prefills_by_worker(spans)
    out: list[dict[str, object]] = []
    for w in (s for s in spans if s.kind == "wait"):
        if not opened.get((w.worker, w.start), True):
            continue
        if any(w.start <= p.start <= w.end for p in prefills.get(w.worker, ())):
            continue
        out.append(
            {
                "worker": w.worker,
                "iteration": w.iteration,
                "start": w.start,
                "predicted_ms": w.predicted_ms,
                "actual_ms": round((bubble_end(w) - w.start) * 1000, 3),
                "recorded": (w.worker, w.start) in opened,  # False: the dispatcher never handled its start
            }
        )
    return out


def report_latencies_ms(seen: Iterable[ControlSeen]) -> list[float]:
    """Per batch report: the worker sent it to the dispatcher handling it (ms)."""
    return [(c.seen - c.at) * 1000 for c in seen if c.event is ControlEvent.REPORT]


def recomputed_share(seen: Iterable[ControlSeen]) -> float | None:
    """Of the prompt layers the workers ran (every batch report the dispatcher handled), the share
    run again because the partial state they would have resumed from was in another datacenter or
    lost; None before any ran. The simulator's figure is the dispatch policy's same count."""
    run = recomputed = 0
    for c in seen:
        if c.event is ControlEvent.REPORT:
            run, recomputed = run + c.layers_run, recomputed + c.layers_recomputed
    return recomputed / run if run else None


def mean_bubble_ms(spans: Iterable[Span]) -> float:
    """The mean bubble of `spans` (start to its input's arrival), real ms; 0 without bubbles."""
    lengths = [bubble_end(s) - s.start for s in spans if s.kind == "wait"]
    return 1000 * sum(lengths) / len(lengths) if lengths else 0.0


def control_shares(latencies_ms: Sequence[float], mean_bubble_real_ms: float, time_scale: float) -> list[float]:
    """Host-side latencies as shares of the mean bubble *in device time* (real ms / k): what each
    would take of a bubble on the device the run stands for, at k = 1."""
    if mean_bubble_real_ms <= 0:
        return []
    device_ms = mean_bubble_real_ms / time_scale
    return [x / device_ms for x in latencies_ms]


def _prefills_by_worker(spans: Iterable[Span]) -> dict[str, list[Span]]:
    by_worker: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.kind == "prefill":
            by_worker[s.worker].append(s)
    for seq in by_worker.values():
        seq.sort(key=lambda s: s.start)
    return by_worker


def prediction_errors_ms(spans: Iterable[Span]) -> list[float]:
    """Per bubble of the steady window (a `wait` span announced with a prediction): |actual length
    - predicted length|, ms. How far the length a worker announced was from the bubble it had."""
    return [
        abs(s.duration * 1000 - s.predicted_ms)
        for s in steady(spans)
        if s.kind == "wait" and s.predicted_ms is not None
    ]


def overruns_ms(spans: Iterable[Span]) -> list[float]:
    """Per filled bubble (a `wait` span with prefill inside it): training input arrived to training
    resumed (the wait's end), ms. What filling the bubble cost training; 0 when prefill had
    stopped before the input came. Their sum is the run's `overrun_ms_total`."""
    spans = list(spans)
    prefills = _prefills_by_worker(spans)
    out = []
    for w in steady(spans):
        if w.kind != "wait" or w.input_at is None:
            continue
        if any(w.start <= p.start < w.end for p in prefills.get(w.worker, ())):
            out.append(max(0.0, (w.end - w.input_at) * 1000))
    return out


def capacity_requests_per_s(
    spans_off: list[Span],
    block_s: Callable[[int], float],
    layers: int,
    tokens: int,
    fit_block_s: float | None = None,
) -> float:
    """The prompts of `tokens` tokens per (real) second the bubbles of a run without BubbleTea could
    hold: its bubble seconds per second, summed over workers (steady window), over what one such
    prompt costs (`layers` blocks of `block_s(tokens)` real seconds); 0 for a prompt that costs
    nothing. The simulator's default load, and what `capacity.offer` offers a share of.

    With `fit_block_s` (the block the fit rule weighs: a layer, or a piece), each bubble counts for
    what the rule can fill of it (`fill.usable_s`), not its whole length: the rest is refused."""
    per_request = layers * block_s(tokens)
    if per_request <= 0:
        return 0.0
    if fit_block_s is None:
        u = utilization(spans_off)
        return u.workers * u.bubble / per_request
    return usable_bubble_s_per_s(spans_off, fit_block_s) / per_request


def usable_bubble_s_per_s(spans_off: list[Span], fit_block_s: float) -> float:
    """The bubble seconds per second the fit rule can fill with blocks of `fit_block_s`, summed
    over workers, over the steady window (as `runstats.utilization` counts the bubbles)."""
    kept = steady(spans_off)
    if not kept:
        return 0.0
    start, end = full_window(kept)
    if end <= start:
        return 0.0
    waits = (s for s in kept if s.kind == "wait")
    return sum(usable_s(min(s.end, end) - max(s.start, start), fit_block_s) for s in waits) / (end - start)


def capacity_tokens_per_s(
    spans_off: list[Span], block_s: Callable[[int], float], layers: int, tokens: int, fit_block_s: float | None = None
) -> float:
    """`capacity_requests_per_s` in prompt tokens per (real) second."""
    return capacity_requests_per_s(spans_off, block_s, layers, tokens, fit_block_s) * tokens
