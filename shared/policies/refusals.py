"""How a request leaves the dispatcher unanswered by the bubbles (pure): refused or moved to the
decoder on arrival, moved or failed when its time is up, failed when nothing can serve.

Small functions over the waiting room (`waiting_room.WaitingRoom`) and admission's rate
(`admission.Admission`); `DispatchState` calls them and counts what they return. Where a prompt
goes is `prompt_placement`'s decision; admission's rate is the prediction it decides on. A move is
a `Moved`, not a failure: the front door has the decoder compute it.
tests/unit/test_prompt_placement.py and tests/unit/test_admission.py pin them.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.policies import prompt_placement as placement
from shared.policies.admission import Admission
from shared.policies.decisions import Failure, Moved, P
from shared.policies.dispatch_inputs import Request
from shared.policies.waiting_room import WaitingRoom
from shared.wire.status import FailureReason


def on_arrival(
    req: Request[P], room: WaitingRoom[P], held_s: float, admission: Admission, bubble_seen: bool, now: float
) -> Failure[P] | Moved[P] | None:
    """A new request refused (OVERLOADED: a 429) or moved to the decoder, because the bubbles are
    predicted not to finish it in time behind the queue's work and the `held_s` held on workers;
    None to queue it (then its predicted wait is noted, to correct the next ones: `waited`)."""
    ahead_s, own_s = room.queued_s + held_s, room.remaining_s(req)
    finish_in = admission.finish_in(ahead_s, own_s, now)
    if req.objective is None:  # a deadline only: admission's margin, as before objectives
        why = admission.refusal(ahead_s, own_s, req.deadline, now)
        verdict = placement.Verdict(None if why else placement.Where.BUBBLES, why or "")
    else:
        verdict = placement.on_arrival(
            finish_in,
            req.due,
            req.objective_s,
            req.may_move,
            now,
            req.decoder_s,
            bubble_seen,
            admission.came_round(now),
        )
    if verdict.where is placement.Where.BUBBLES:
        req.predicted_wait_s = admission.raw_finish_in(ahead_s, own_s, now)  # what corrects the next
        return None
    if verdict.where is placement.Where.DECODER:
        return Moved(req.id, req.ticket, req.payload, verdict.why)
    why = verdict.why if verdict.why.startswith("overloaded") else f"overloaded: {verdict.why}"
    return Failure(req.id, req.ticket, req.payload, FailureReason.OVERLOADED, why)


def waited(admission: Admission, req: Request[P], now: float) -> None:
    """`req` is answered, or failed at its due time, at `now`: its real wait corrects admission's
    next predictions (`Admission.waited`)."""
    if req.predicted_wait_s is not None and req.due is not None:
        admission.waited(req.predicted_wait_s, now - req.arrival, req.due - req.arrival)


def expire(
    room: WaitingRoom[P], admission: Admission, running: Callable[[str], bool], tick_s: float, now: float
) -> tuple[tuple[Moved[P], ...], tuple[Failure[P], ...]]:
    """The requests whose time is up at `now` leave the room (`WaitingRoom.expiring`): moved to
    the decoder once their bubble has not come by the last tick before `moves_at`, failed past
    their objective or deadline."""
    moved, late = room.expiring(now, tick_s, running)
    for r in late:
        waited(admission, r, now)
    for r in moved + late:
        room.leave(r)

    def why(r: Request[P]) -> str:
        return f"no bubble started it by {now - r.arrival:.3f}s after arrival"

    return (
        tuple(Moved(r.id, r.ticket, r.payload, why(r)) for r in moved),
        tuple(Failure(r.id, r.ticket, r.payload, FailureReason.DEADLINE, r.late(now)) for r in late),
    )


def unavailable(room: WaitingRoom[P], running: Callable[[str], bool], why: str) -> tuple[Failure[P], ...]:
    """Nothing can serve: every request not running in an open bubble leaves the room, failed
    with `why`. One that runs finishes (or is failed once it is handed back)."""
    gone = room.not_running(running)
    for r in gone:
        room.leave(r)
    return tuple(Failure(r.id, r.ticket, r.payload, FailureReason.UNAVAILABLE, why) for r in gone)
