"""A queued prefill batch run on the `PrefillModel`, one block at a time (the fill executor's compute:
`executor.py` decides when, and in which thread, this runs).

A block is one layer of one request, or with `piece_tokens` (a GPU) one piece of a layer's tokens.
Each starts only while training's awaited input has not arrived, and only if its expected time
(the profile's, or as measured here) fits what is left of the bubble by its prediction: the fit
rule, `shared.policies.fill.may_start`, which the simulator obeys too. A CPU's layers are timed on
the host's clock as they run; pieces on the device without waiting for them (`LaneClock`). A
finished request's first token is read off the device later, by whoever answers it (`Finishing`):
the prefill thread never waits for the GPU but to keep itself one block ahead (`Lane.pace`).

With a device profile the run keeps to its profiled schedule (`Schedule`): a block starts once the
previous one is due (a started block counts for its whole profiled time, the thread sleeping out
the rest: a GPU kernel is not cut short), and the run ends on the device when its last block is
due, or when its real work ended if that was later (added to `lag_s`).

A request is answered as soon as it is done (`Answered`, called by the run), not when its run ends:
the batch's later requests, or the rest of the bubble, would otherwise delay its first token past
the time the worker checked it could meet (`late_on_worker` counts its own blocks only). With a
profile, it is done when its last block and its first token's read are due on the schedule.

Tested by: tests/integration/test_fill_executor.py, tests/integration/test_prefill_profile.py,
tests/integration/test_fit_rule.py.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

from services.stage_worker.fill.batch import Answered, Arrived, Outcome, Queued, Run
from services.stage_worker.fill.guest_faults import Guest
from shared.model.lanes import LaneClock
from shared.model.prefill import PrefillModel, PrefillState
from shared.policies.fill import (
    BlockTimes,
    Start,
    late_on_worker,
    left_s,
    may_start,
    moved_on_worker,
)
from shared.policies.prefill_cost import PrefillProfile
from shared.runtime.timing import Schedule
from shared.wire import PrefillItem
from shared.wire.status import FailureReason


@dataclass
class _Running:
    """A run in progress: when it began (wall clock; `schedule` from the monotonic clock's
    `origin`), the blocks it ran, and the guest's error if the prefill model raised."""

    started: float
    origin: float
    schedule: Schedule
    blocks: int = 0
    error: str | None = None

    def device_free(self) -> float:
        """When the device is free for the next block (monotonic): now, or when the last is due."""
        return max(self.schedule.due, time.monotonic())


class BatchCompute:
    def __init__(
        self,
        model: PrefillModel,
        guest: Guest,
        profile: PrefillProfile | None = None,
        piece_tokens: int | None = None,
    ) -> None:
        self.model, self.guest, self.profile = model, guest, profile
        self.piece_tokens = piece_tokens  # a layer in pieces of this many tokens (None: whole layers)
        self.blocks = BlockTimes()  # measured, where there is no profile
        self.clock = LaneClock(model.lane)
        #: how far prefill batches ran past their profiled schedule (seconds); the runner takes it
        #: each iteration (`take_lag`), the thread adds to it (a float under the GIL)
        self.lag_s = 0.0

    def steps(
        self, q: Queued, arrived: Arrived, ends_at: float | None, answered: Answered
    ) -> Generator[None, None, Run]:
        """Steps through `q` from where it stopped, pausing (yield) after each block, so that
        whichever thread advances it runs the next block; returns the `Run`. `ends_at`: the
        bubble's predicted end (monotonic clock; None: no prediction); `answered` takes each
        outcome as it is answered. The run stops at the batch's end, where the fit rule refuses a
        block (`Start.INPUT`, `Start.FULL`: the batch goes on in a later bubble), or where the
        guest failed (`Run.error`: the batch ends here)."""
        origin = time.monotonic()
        run = _Running(time.time(), origin, Schedule(origin))
        start = Start.GO
        while start is Start.GO and run.error is None and q.cursor < len(q.batch.items):
            start = yield from self._next_item(q, run, arrived, ends_at, answered)
        return self._ended(q, run, full=start is Start.FULL)

    def _next_item(
        self, q: Queued, run: _Running, arrived: Arrived, ends_at: float | None, answered: Answered
    ) -> Generator[None, None, Start]:
        """The item at `q`'s cursor, run as far as it may. `Start.GO`: on to the next item (this one
        is done, failed or left unrun); `INPUT` or `FULL`: the fit rule cut it, and the run stops."""
        o = self._resume_or_begin(q, run.started)
        if o.state is None:  # answered before any block (failed), or left unrun (moved to the decoder)
            q.current, q.cursor = None, q.cursor + 1
            if o.answered:
                answered(o)
                run.error = self.guest.error_of(o)
            return Start.GO
        t0 = run.device_free()
        ran, start, raised = yield from self._run_blocks(o.state, o.item.to_layer, arrived, run.schedule, ends_at)
        run.blocks += ran
        o.seconds += run.device_free() - t0
        o.reached = o.state.next_layer
        if raised is not None:
            run.error = self.guest.failed(o, raised)  # (its state dropped)
        elif start is not Start.GO:  # the input came, or the bubble is full: it goes on later
            q.current = o
            return start
        q.current, q.cursor = None, q.cursor + 1
        if o.state is not None and o.state.done:
            run.error = self._finish(o, o.state, run.schedule)
        if o.answered:
            answered(o)
        return Start.GO

    def _resume_or_begin(self, q: Queued, bubble_started: float) -> Outcome:
        """The outcome at `q`'s cursor: the one an earlier bubble cut (failed now if it would finish
        too late, `_too_late_to_resume`), or one beginning now (`_begin`)."""
        if q.current is None:
            return self._begin(q, q.batch.items[q.cursor], bubble_started)
        self._too_late_to_resume(q.current)
        return q.current

    def _finish(self, o: Outcome, state: PrefillState, schedule: Schedule) -> str | None:
        """`o`'s last block ran: its first token sampled, read off the device here or later (by the
        answer), done once due on the schedule. Returns the guest's error if the model raised."""
        item, error = o.item, None
        try:
            pending = self.model.finish_async(
                state, temperature=item.temperature, seed=item.seed, top_logprobs=item.logprobs
            )
            if pending.ready():  # on the host already (a CPU): read here, as it always was
                o.result = pending.result()
            else:  # on its way off a GPU: read by the answer, in a thread (`Outcome.read`)
                o.pending = pending
            if self.profile is not None:  # its first token's read, on the device's clock
                schedule.add(self.profile.sync_s)
                o.seconds += self.profile.sync_s
        except ValueError as exc:
            o.failure = (FailureReason.MODEL_REFUSED, str(exc))
        except Exception as exc:  # the guest failed (executor.py's docstring)
            error = self.guest.failed(o, exc)
        if (wait := schedule.wait_s(time.monotonic())) > 0:
            time.sleep(wait)  # done on the device once due (the next block would wait as long)
        return error

    def _ended(self, q: Queued, run: _Running, *, full: bool) -> Run:
        """The run's end: on the device, when its last block is due, or when its real work ended if
        that was later (the difference added to `lag_s`)."""
        done = time.monotonic()  # the run's real work ended
        if self.profile is not None and run.blocks:
            self.lag_s += run.schedule.behind(done)
            if (wait := run.schedule.wait_s(done)) > 0:
                time.sleep(wait)  # the last block still runs on the device
        ended = run.started + max(run.schedule.due, done) - run.origin
        finished = run.error is None and q.cursor >= len(q.batch.items)
        return Run(run.started, ended, run.blocks, finished, run.error, full)

    def _too_late_to_resume(self, o: Outcome) -> bool:
        """Whether `o`, cut by training input in an earlier bubble, would now finish after its
        prompt is due: then it fails (`DEADLINE`, its state dropped) rather than answer late, as
        an item the worker comes to too late does (`_begin`)."""
        item, now = o.item, time.time()
        left = left_s(item.predicted_ms / 1000, item.from_layer, item.to_layer, o.reached)
        if not late_on_worker(item.due or None, now, left):
            return False
        why = (
            f"cut by training input, it would finish after its prompt is due ({item.due - now:.3f}s from when it "
            f"could resume, {left * 1000:.0f}ms of its predicted time left)"
        )
        o.failure, o.state = (FailureReason.DEADLINE, why), None
        return True

    def _begin(self, q: Queued, item: PrefillItem, bubble_started: float) -> Outcome:
        """The outcome of an item starting now: from its saved state, or from its prompt (its
        state is elsewhere or lost), or failed (too late to finish by its due time, its state
        expired, or the model refuses it), or left unrun, with no state (its prompt may have moved
        to the decoder: `bubble_started`, when this run began, is past when it would have moved)."""
        now = time.time()
        if moved_on_worker(item.moves_from or None, bubble_started):
            o = Outcome(item, item.from_layer, 0.0)
        elif late_on_worker(item.due or None, now, item.predicted_ms / 1000):  # it would answer late
            left = item.due - now
            why = (
                f"it would finish after its prompt is due (its objective or deadline, {left:.3f}s from when "
                f"this worker came to it; predicted {item.predicted_ms:.0f}ms)"
            )
            o = Outcome(item, item.from_layer, 0.0, failure=(FailureReason.DEADLINE, why))
        elif item.from_layer and q.states.get(item.id) is None:
            why = "its saved partial state expired before it could resume"
            o = Outcome(item, item.from_layer, 0.0, failure=(FailureReason.STATE_EXPIRED, why))
        else:
            saved = q.states.get(item.id)  # LOST or ELSEWHERE: computed again from the prompt
            try:
                state = saved if isinstance(saved, PrefillState) else self.model.start(item.tokens)
            except ValueError as exc:  # a prompt this model cannot run (e.g. another spec's limits)
                o = Outcome(item, item.from_layer, 0.0, failure=(FailureReason.MODEL_REFUSED, str(exc)))
            except Exception as exc:  # the guest failed (executor.py's docstring)
                o = Outcome(item, item.from_layer, 0.0)
                self.guest.failed(o, exc)
            else:
                started = None if state.next_layer == item.from_layer else state.next_layer
                o = Outcome(item, state.next_layer, 0.0, state, started=started)
        q.outcomes.append(o)
        return o

    def _may_start(self, state: PrefillState, arrived: Arrived, ends_at: float | None) -> Start:
        """The fit rule for the next block of `state` (`shared.policies.fill.may_start`)."""
        tokens = self._next_block_tokens(state)
        left_s = None if ends_at is None else ends_at - time.monotonic()
        input_arrived = arrived()
        block_s = self.block_s(tokens)
        busy_s = 0.0
        if self.piece_tokens is not None and self.profile is None:  # a profile's schedule waits for them
            in_flight = self.clock.in_flight_tokens()
            busy_s = (self.blocks.predict(in_flight, time.monotonic()) or 0.0) if in_flight else 0.0
        return may_start(input_arrived=input_arrived, block_s=block_s, left_s=left_s, busy_s=busy_s)

    def _next_block_tokens(self, state: PrefillState) -> int:
        """The prompt tokens the next block of `state` computes: the whole prompt (a layer), or a piece."""
        if self.piece_tokens is None:
            return len(state.tokens)
        return min(self.piece_tokens, len(state.tokens) - state.piece_done)

    def block_s(self, tokens: int) -> float | None:
        """A block's expected time: the profile's, or as measured here (None: not yet)."""
        if self.profile is not None:
            return self.profile.block_s(tokens)
        if self.piece_tokens is not None:
            now = time.monotonic()
            for n, seconds in self.clock.measured():
                self.blocks.observe(n, seconds, now)
        return self.blocks.predict(tokens, time.monotonic())

    def _run_blocks(
        self, state: PrefillState, to_layer: int, arrived: Arrived, schedule: Schedule, ends_at: float | None
    ) -> Generator[None, None, tuple[int, Start, Exception | None]]:
        """Blocks of one request up to `to_layer` while they may start, each started once the
        run's `schedule` has the previous one done, pausing after each. Returns how many ran, the
        fit rule's refusal that stopped them (`Start.GO`: none, they all ran), and what the model
        raised if it did (the run stops there)."""
        ran = 0
        while state.next_layer < to_layer and not state.done:
            if (wait := schedule.wait_s(time.monotonic())) > 0:
                time.sleep(wait)  # the previous block still runs; sleeping releases the GIL
            start = self._may_start(state, arrived, ends_at)
            if start is not Start.GO:
                return ran, start, None
            try:
                tokens = self._run_block(state)
            except Exception as exc:  # the guest failed: the caller fails the request, training goes on
                return ran, Start.GO, exc
            if self.profile is not None:
                schedule.add(self.profile.block_s(tokens))
            ran += 1
            yield
        return ran, Start.GO, None

    def _run_block(self, state: PrefillState) -> int:
        """One block of `state`: a layer (timed here without a profile), or a piece (timed on the
        device's lane without one). Returns the prompt tokens it computed."""
        if self.piece_tokens is None:
            t0 = time.monotonic()
            self.model.run_layers(state, max_layers=1)  # on the host: done when it returns
            if self.profile is None:
                done = time.monotonic()
                self.blocks.observe(len(state.tokens), done - t0, done)
            return len(state.tokens)
        if self.profile is not None:  # its time is the profile's
            return self.model.run_piece(state, self.piece_tokens)
        mark = self.clock.begin()
        tokens = self.model.run_piece(state, self.piece_tokens)
        self.clock.end(mark, tokens)
        return tokens

    def take_lag(self) -> float:
        """Prefill lag behind the profile since the last call, seconds."""
        lag, self.lag_s = self.lag_s, 0.0
        return lag


def run_to_end(steps: Generator[None, None, Run]) -> Run:
    """In the prefill thread: the rest of a run the event loop started."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            run: Run = done.value
            return run
