"""What the dispatcher writes for its decisions: a batch as the worker's `PrefillBatch`, a failure
as the request's `PrefillResult` (the wire messages, built from the policy's values)."""

from __future__ import annotations

import time

from shared.policies.decisions import Batch, Failure
from shared.wire import PrefillBatch, PrefillItem, PrefillRequest, PrefillResult, keys
from shared.wire.status import FailureReason, RequestStatus


def batch_message(run: str, batch: Batch) -> PrefillBatch:
    """`batch` for its worker's fill stream: each item with its prompt, sampling, where its saved
    state is (resuming past layer 0), and the predicted ms it counts for in the worker's credit."""
    items = []
    for it in batch.items:
        req: PrefillRequest = it.payload
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
                snapshot_key=keys.prefill_snapshot_key(run, req.id, it.from_layer) if it.from_layer else "",
                predicted_ms=it.seconds * 1000,
                due=it.due or 0.0,
                moves_from=it.moves_from or 0.0,
            )
        )
    return PrefillBatch(run=run, worker=batch.worker, batch_id=batch.batch_id, items=tuple(items))


def failure_result(f: Failure) -> PrefillResult:
    """The explicit answer of a request the dispatcher failed (its reason, in a sentence), or moved
    to the decoder (status MOVED: the front door has the decoder compute it)."""
    req: PrefillRequest = f.payload
    now = time.time()
    return PrefillResult(
        id=f.id,
        status=RequestStatus.MOVED if f.reason is FailureReason.TO_DECODER else RequestStatus.FAILED,
        reason=f.reason,
        error=f.detail,
        prompt_tokens=len(req.tokens),
        queue_ms=(now - req.submitted) * 1000,
        finished=now,
    )
