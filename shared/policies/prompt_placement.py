"""Prompt placement (pure): where a prompt is computed, in the training bubbles or by the decoder itself.

A request may carry a TTFT objective: the time by which its first token is due. The bubbles are
free prefill, but a prompt waits for them; a decoder (vLLM, or the built-in decoder service) can
compute the prompt itself at once, at the cost of its own GPU time. `prefill.placement` says which may be used:

* ``bubbles``: the bubbles only. A request they cannot finish by its objective (with `MARGIN` of
  it to spare, for the prediction's error) is refused at once (429 with Retry-After); one whose
  objective passes while it waits fails there (a 504): it is never queued past its objective.
* ``decoder``: the decoder computes every prompt; the bubbles are not used.
* ``auto`` (the default where a decoder can compute prompts): the bubbles when they are predicted
  to finish the prompt by its objective less the time kept for the decoder (`RESERVE` of it, or
  what the decoder's recent prompts took when that is longer: `decoder_s`), and the decoder
  otherwise. A request that waits for the bubbles is moved to the decoder once its bubble has not
  come by `moves_at` (the latest start that still finishes before the reserve).

The prediction is admission's (`shared.policies.admission`): the prefill queued ahead of the request
(the dispatcher's queue and all the work held on workers, which runs first) and the request's own,
served at the rate the bubbles offered over the recent window. Before the run's first bubble, and
until the pipeline has come round once (`Admission.came_round`), nothing says when they would start
it: a request with an objective goes to the decoder or is refused. With no rate later (no bubble in
the window: a paused pipeline, the readiness gate's call) the bubbles are assumed to meet it: the
move at `moves_at` is the safety net.

Whether the decoder can meet the objective in its turn is the front door's to judge, from what it
has sent the decoder (`DecoderLoad`): a request neither can serve in time is refused with a 429.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.policies.recent import Recent
from shared.wire.status import PromptPlacement

#: Of a request's objective, the share kept for the decoder's own prefill (auto): the bubbles take a
#: prompt only if predicted to finish it before this share of the objective is left, and a prompt
#: still waiting for a bubble then moves to the decoder. vLLM alone computed a 1k-token prompt on
#: this machine's two cores in about 80 ms at its p99 (docs/benchmarks.md); 0.3 of a 500 ms
#: objective (150 ms) covers that with the hop to it.
RESERVE = 0.3
#: Of a request's objective, the share kept for the prediction's error where no decoder can take the
#: prompt (bubbles only): admission's margin.
MARGIN = 0.15
#: The decoder's predicted time to a first token is this quantile of its recent ones (`DecoderLoad`).
QUANTILE = 0.9


class Mode(enum.StrEnum):
    """`prefill.placement`: where prompts may be computed."""

    BUBBLES = "bubbles"
    AUTO = "auto"
    DECODER = "decoder"


#: Where one prompt is computed (named in its answer and in the metrics' labels).
Where = PromptPlacement


def mode_of(placement: str | None, decode_enabled: bool) -> Mode:
    """`prefill.placement`, or its default: auto wherever a decoder is configured (vLLM or the
    built-in decoder service: both compute prompts themselves), else bubbles."""
    if placement is not None:
        return Mode(placement)
    return Mode.AUTO if decode_enabled else Mode.BUBBLES


@dataclass(frozen=True)
class Verdict:
    """A placement: `where` (None: refused, a 429) and why, in a sentence."""

    where: Where | None
    why: str


def kept_s(objective_s: float, may_move: bool, decoder_s: float = 0.0) -> float:
    """Of an objective of `objective_s`, the seconds kept from the bubbles' share: the decoder's
    reserve where it may take the prompt (`RESERVE` of it, or `decoder_s`, what the decoder's recent
    prompts took to a first token when the request came, if longer: a prompt moved with less left
    would be refused there, late), the prediction's margin otherwise. A decoder as slow as the
    objective itself could not take the prompt in time at all: the reserve is kept for it then, no
    more (keeping its time would leave the bubbles nothing, and every prompt refused)."""
    if not may_move:
        return MARGIN * objective_s
    return max(RESERVE * objective_s, decoder_s) if decoder_s < objective_s else RESERVE * objective_s


def on_arrival(
    finish_in_s: float | None,
    due: float | None,
    objective_s: float | None,
    may_move: bool,
    now: float,
    decoder_s: float = 0.0,
    started: bool = True,
    came_round: bool = True,
) -> Verdict:
    """Where a request arriving at `now` goes. `finish_in_s`: when the bubbles are predicted to
    finish it from now (None: no prediction yet); `due`: when its prompt must be done (its objective,
    or its deadline, the sooner); `objective_s`: its objective's length (the share kept is of it);
    `decoder_s`: the decoder's recent time to a first token (`kept_s`); `started`: whether a bubble
    was seen yet. Before the first, nothing says when one will come (the workers are still setting
    up, then the first iteration starts when the last has): a request with an objective goes to the
    decoder, or is refused. (Taken, they waited for the first bubbles: in compose, every request of
    the first second of a burst sent as the workers joined failed at its 500 ms objective, 2026-11-29.)
    Likewise until the pipeline has `came_round` once (`Admission.came_round`): before that nothing
    says how fast its bubbles serve. (Taken, a load five times their capacity sent from the moment
    `bubbletea up` was ready waited for its first round, and 17% of it failed at its objective,
    2026-12-02.)"""
    if due is not None and objective_s is not None and not (started and came_round):
        why = (
            "no bubble yet: training has not started, and nothing says when its first bubbles come"
            if not started
            else "the pipeline has not come round once yet: nothing says how fast its bubbles serve"
        )
        return Verdict(Where.DECODER if may_move else None, why)
    if finish_in_s is None or due is None:
        return Verdict(Where.BUBBLES, "no objective" if due is None else "no rate of the bubbles measured yet")
    kept = kept_s(objective_s if objective_s is not None else due - now, may_move, decoder_s)
    room = due - kept - now
    if finish_in_s <= room:
        return Verdict(Where.BUBBLES, f"the bubbles finish it in about {finish_in_s:.3f}s, {room:.3f}s allowed")
    why = f"the bubbles would finish it in about {finish_in_s:.3f}s; {max(0.0, room):.3f}s allowed"
    return Verdict(Where.DECODER if may_move else None, why)


def moves_at(due: float, objective_s: float, own_s: float, decoder_s: float = 0.0) -> float:
    """When a prompt of `own_s` predicted seconds still waiting for a bubble moves to the decoder:
    the latest start that finishes it before the decoder's reserve of its objective (`kept_s`)."""
    return due - kept_s(objective_s, True, decoder_s) - own_s


#: A decoder's first-token time older than this (seconds) no longer predicts the next one: a decoder
#: judged too slow is sent nothing, so nothing newer would ever say it has caught up. A front door
#: that kept a slow minute's times refused every prompt of the next load it was offered
#: (`bench/pd_vllm.py --sweep`, 2026-11-29).
DECODER_TIMES_HORIZON_S = 10.0


@dataclass
class DecoderLoad:
    """The front door's view of the decoder's own prefill: may it compute one more prompt by its
    objective? The decoder batches the prompts it computes (vLLM's continuous batching), so what one
    more will take is what the recent ones took under the load there is now: the `QUANTILE` of the
    last `window` first-token times of the last `DECODER_TIMES_HORIZON_S`. (A model summing the
    prompt tokens in flight over one request's rate, tried first, refused prompts vLLM then served
    in time: at 8 requests/s of 16-200-token prompts it predicted 0.2 s where vLLM took 0.03 s,
    2026-11-28.) With none measured in that time, it is assumed to meet it: the next prompt measures
    it again."""

    window: int = 32  # the recent first tokens the prediction is taken over
    in_flight: int = 0  # prompts sent and not yet answered (for the log: the prediction is the times')
    _recent: Recent = field(init=False)  # seconds from sending to the first token, when it came

    def __post_init__(self) -> None:
        self._recent = Recent(self.window, QUANTILE, DECODER_TIMES_HORIZON_S)

    def predicted_s(self, now: float) -> float | None:
        """What one more prompt is predicted to take to its first token, or None (none measured in
        the last `DECODER_TIMES_HORIZON_S`)."""
        return self._recent.quantile(now)

    def verdict(self, left_s: float | None, now: float) -> Verdict:
        """Whether a prompt, its objective `left_s` from `now` (None: none), is sent to the decoder
        (`Where.DECODER`) or refused."""
        wait = self.predicted_s(now)
        if left_s is None or wait is None:
            return Verdict(Where.DECODER, "no objective" if left_s is None else "no decoder time measured yet")
        if wait <= left_s:
            return Verdict(Where.DECODER, f"the decoder computes it in about {wait:.3f}s, {left_s:.3f}s left")
        return Verdict(
            None,
            f"overloaded: the decoder's recent prompts took {wait:.3f}s to a first token ({self.in_flight} in "
            f"flight), past this one's objective in {max(0.0, left_s):.3f}s",
        )

    def sent(self) -> None:
        self.in_flight += 1

    def answered(self, seconds: float | None, now: float) -> None:
        """Its first token came at `now`, `seconds` after it was sent, or it failed (None)."""
        self.in_flight = max(0, self.in_flight - 1)
        if seconds is not None and seconds > 0:
            self._recent.add(seconds, now)


#: Of a request's objective, at most this share is kept for the front door's own hops (`FrontDoorHops`).
HOPS_MAX_SHARE = 0.25
#: The hops kept are this quantile of the recent ones. Their tail is long where the front door shares
#: its cores with the rest: in compose on 2 cores (2026-11-29) the median hop took 8 ms, the 90th
#: percentile about 25 ms and the largest of 64 50-100 ms, which, kept (the 99th percentile, tried
#: that day), left the workers as little as 0.4 s of a 500 ms objective, for the sake of the few
#: answers whose hops were that long.
HOPS_QUANTILE = QUANTILE


@dataclass
class FrontDoorHops:
    """The share of a time to first token that comes after the worker's answer or before the
    dispatcher sees the request: from the front door receiving a request to queueing its prompt,
    from the worker's answer (its `finished`) to its landing here through Redis, and from its
    landing to the first byte written. The objective is the client's, so the time the dispatcher
    and the workers are given (the request's `objective`) is it less the `HOPS_QUANTILE` of the
    last `window` of these hops, at most `HOPS_MAX_SHARE` of the objective. (With the objective
    given whole, `bench/up_overload.py` saw 6% of the answers late, by 24.5 ms at the median,
    2026-11-28.) What comes before the front door's handler and after its write (the network, the
    client's own event loop) is not seen here: the answer's `Server-Timing` says how long the front
    door saw, and a client can set the two side by side."""

    window: int = 64
    _recent: Recent = field(init=False)

    def __post_init__(self) -> None:
        self._recent = Recent(self.window, HOPS_QUANTILE)

    def observed(self, seconds: float) -> None:
        """One request's hops through the front door, in seconds."""
        self._recent.add(max(0.0, seconds))

    def kept_s(self, objective_s: float) -> float:
        """Of an objective of `objective_s`, the seconds kept for the front door's hops."""
        hops = self._recent.quantile()
        return 0.0 if hops is None else min(hops, HOPS_MAX_SHARE * objective_s)
