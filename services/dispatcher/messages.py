"""What the dispatcher writes for its decisions: a batch as the worker's `PrefillBatch`, a failure
or a move as the request's `PrefillResult` (the wire messages, built from the policy's values), and
the saved partial prefills they leave unused.

Tested by: tests/integration/test_dispatcher.py (batches, failures, moves as written).
"""

from __future__ import annotations

import time

from shared.policies.decisions import Batch, Decisions, Failure, Moved
from shared.wire import PrefillBatch, PrefillItem, PrefillRequest, PrefillResult, keys
from shared.wire.status import FailureReason, RequestStatus


def batch_message(run: str, batch: Batch[PrefillRequest], dc: str | None = None) -> PrefillBatch:
    """`batch` for its worker's fill stream: each item with its prompt, sampling, where its saved
    state is (resuming past layer 0), and the predicted ms it counts for in the worker's credit."""
    items = []
    for it in batch.items:
        req = it.payload
        items.append(
            PrefillItem(
                id=req.id,
                tokens=req.tokens,
                from_layer=it.from_layer,
                to_layer=it.to_layer,
                temperature=req.temperature,
                seed=req.seed,
                logprobs=req.logprobs,
                submitted=req.submitted,
                reply_to=req.reply_to,
                snapshot_key=keys.prefill_snapshot_key(run, req.id, it.from_layer, dc) if it.from_layer else "",
                predicted_ms=it.seconds * 1000,
                due=it.due or 0.0,
                moves_from=it.moves_from or 0.0,
            )
        )
    return PrefillBatch(run=run, worker=batch.worker, batch_id=batch.batch_id, items=tuple(items))


def unanswerable(run: str, dc: str | None, req: PrefillRequest) -> str | None:
    """Why `req` can never be answered by `run`'s dispatcher (`dc`'s), or None: it asks for its
    answer on a stream outside the dispatcher's tag, where no front door reads for it (on a
    cluster, another slot, which the answer script cannot write)."""
    if keys.under_dispatch_tag(req.reply_to, run, dc):
        return None
    where = f"run {run}'s" if dc is None else f"datacenter {dc}'s (run {run})"
    return f"request {req.id} asks for its answer on {req.reply_to!r}, outside {where} streams"


def answers(ds: Decisions[PrefillRequest]) -> list[tuple[PrefillResult, str]]:
    """The answers of the requests `ds` failed or moved, each with its reply stream."""
    failed = [(failure_result(f), f.payload.reply_to) for f in ds.failed]
    return failed + [(moved_result(m), m.payload.reply_to) for m in ds.moved]


def unused_states(run: str, ds: Decisions[PrefillRequest], layers: int, dc: str | None = None) -> list[str]:
    """The keys of the partial prefills no batch resumes from again: spent ones, and any a failed
    or moved request may have left. They go now, not at their TTL (under overload, requests
    failing at their deadline left ~0.5 GB of them)."""
    spent = [keys.prefill_snapshot_key(run, s.id, s.layer, dc) for s in ds.spent]
    left = [f.id for f in ds.failed] + [m.id for m in ds.moved]
    return spent + [keys.prefill_snapshot_key(run, rid, n, dc) for rid in left for n in range(1, layers)]


def failure_result(f: Failure[PrefillRequest]) -> PrefillResult:
    """The explicit answer of a request the dispatcher failed: its reason, in a sentence."""
    return _result(f.id, f.payload, RequestStatus.FAILED, f.reason, f.detail)


def moved_result(m: Moved[PrefillRequest]) -> PrefillResult:
    """The answer of a request the dispatcher moved to the decoder: status MOVED (the front door
    has the decoder compute it), reason TO_DECODER, and why."""
    return _result(m.id, m.payload, RequestStatus.MOVED, FailureReason.TO_DECODER, m.why)


def _result(id: str, req: PrefillRequest, status: RequestStatus, reason: FailureReason, error: str) -> PrefillResult:
    now = time.time()
    return PrefillResult(
        id=id,
        status=status,
        reason=reason,
        error=error,
        prompt_tokens=len(req.tokens),
        queue_ms=(now - req.submitted) * 1000,
        finished=now,
    )
