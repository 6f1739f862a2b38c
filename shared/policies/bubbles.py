"""Bubble length prediction for one worker (pure).

A worker announces each bubble with a predicted length; the dispatcher fills at most that much
(minus a guard), so over-predicting would delay training. The prediction is therefore
conservative: the shortest of the last few bubbles seen at the same schedule position. Before any
history exists it is the analytic pipeline model's length for that position.

Bubbles of the warm-up iterations (the first: start-up, first tensors, allocator warm-up) do not
enter the history: they are not what later iterations look like, and one short warm-up bubble
would otherwise pin the prediction of its position for `HISTORY` iterations (measured: a 120 ms
bubble announced as 1.5 ms, left empty, four iterations running). A position the analytic model
gives no prior for (the step's wait for the pipeline's collectives, which it does not model) is
predicted from its last warm-up bubble until it has history: better than 0, which left the first
steady iteration's step bubbles empty (1/7 of their time in an 8-iteration run).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

#: How many past bubbles per position the prediction looks at.
HISTORY = 4
#: Iterations whose bubbles are warm-up, not history (the figures leave iteration 0 out likewise).
WARMUP_ITERATIONS = 1


@dataclass
class BubblePredictor:
    #: schedule position -> bubble length (s) from the analytic model
    prior: dict[int, float] = field(default_factory=dict)
    history: int = HISTORY
    _seen: dict[int, collections.deque[float]] = field(default_factory=dict)
    #: the last warm-up bubble per position: the prediction where there is neither history nor prior
    _warmup: dict[int, float] = field(default_factory=dict)
    #: Bubbles observed, and how many of them were over-predicted (counts, not a list: a run that
    #: trains until stopped observes bubbles forever)
    observed: int = 0
    over_predicted: int = 0

    def predict(self, position: int) -> float:
        seen = self._seen.get(position)
        if seen:
            return min(seen)
        return self.prior.get(position) or self._warmup.get(position, 0.0)

    def room(self, position: int) -> float | None:
        """What the fit rule takes the bubble at `position` to last (`fill.may_start`): `predict`,
        or where that has nothing (no history, no warm-up bubble, no prior for the position), 0
        if the analytic model gave priors (it expects no bubble there: a bus hop's wait, too short
        for a block) and None if it gave none (nothing is known: only the input stops prefill).
        A position the model expects no bubble at, filled with no prediction, overran its 0.6 ms
        wait by a whole 2.55 ms block in the simulator at 2,048 GPUs (issue 63)."""
        predicted = self.predict(position)
        if predicted > 0 or self._seen.get(position) or position in self._warmup or position in self.prior:
            return predicted
        return 0.0 if self.prior else None

    def typical(self) -> float:
        """The median of this worker's predicted bubbles, one per schedule position (0.0 when it
        predicts none): the size of the work worth staging on it before a bubble opens."""
        lengths = sorted(self.predict(p) for p in self.prior.keys() | self._seen.keys() | self._warmup.keys())
        return lengths[len(lengths) // 2] if lengths else 0.0

    def observe(self, position: int, predicted: float, actual: float, iteration: int = WARMUP_ITERATIONS) -> None:
        if iteration >= WARMUP_ITERATIONS:
            self._seen.setdefault(position, collections.deque(maxlen=self.history)).append(actual)
        else:
            self._warmup[position] = actual
        self.observed += 1
        self.over_predicted += predicted > actual

    def over_predicted_share(self) -> float:
        """Share of bubbles whose prediction exceeded the real length."""
        return self.over_predicted / self.observed if self.observed else 0.0
