"""After a prefill batch, off the training path: answer, save, report.

Finished requests are answered (first token, logprobs, KV handle; `serving.answer`, first answer
wins) and their KV caches stored; a request the model cannot run, or whose saved state expired, is
failed with its reason; preempted ones are snapshotted at the layer they reached so any worker can
resume them; then one `PrefillReport` tells the dispatcher where every item got to. The fill
executor acks the batch only after this, so a worker killed mid-batch leaves it for the dispatcher
to requeue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port import KvStored, StagePort
from shared.bus import Bus
from shared.control import keys, serving
from shared.control.status import FailureReason, ItemOutcome, RequestStatus
from shared.model.prefill import PrefillResult, PrefillState
from shared.runtime.logs import get_logger
from shared.wire import PrefillBatch, PrefillItem, PrefillProgress, PrefillReport
from shared.wire import PrefillResult as ResultMessage

log = get_logger(__name__)

#: "KV budget full" is logged at most this often (with how many caches were skipped meanwhile).
BUDGET_LOG_EVERY_S = 60.0


@dataclass
class Outcome:
    item: PrefillItem
    reached: int
    seconds: float
    state: PrefillState | None = None
    result: PrefillResult | None = None
    failure: tuple[FailureReason, str] | None = None


@dataclass
class BatchRun:
    started: float  # wall clock when the first block began
    ended: float
    outcomes: list[Outcome]
    preempted: bool
    out_of_time: bool = False  # stopped because the next block would end after the bubble's predicted end

    @classmethod
    def unrun(cls) -> BatchRun:
        """A batch handed back before any of it ran (its bubble was over, or never came)."""
        return cls(0.0, time.time(), [], preempted=True)


@dataclass
class Reporter:
    bus: Bus
    run: str
    worker: str
    model_name: str
    #: Where the KV caches and snapshots go (the stage's port; nothing below it is called here).
    port: StagePort
    metrics: WorkerMetrics | None = None
    #: When "KV budget full" was last logged (monotonic), and how many caches were skipped since.
    _budget_logged: float = field(default=-BUDGET_LOG_EVERY_S, repr=False)
    _budget_skipped: int = field(default=0, repr=False)

    async def finish_batch(self, batch: PrefillBatch, run: BatchRun) -> None:
        r = self.bus.redis
        progress: list[PrefillProgress] = []
        for o in run.outcomes:
            if o.result is not None:
                await self._answer(o, o.result)
                outcome = ItemOutcome.DONE
            elif o.failure is not None:
                reason, why = o.failure
                failed = ResultMessage(
                    id=o.item.id,
                    status=RequestStatus.FAILED,
                    reason=reason,
                    error=why,
                    worker=self.worker,
                    finished=time.time(),
                )
                await serving.answer(r, failed, o.item.reply_to)
                outcome = ItemOutcome.FAILED
            else:
                if o.state is not None and o.reached > o.item.from_layer:
                    await self.port.save_snapshot(o.item.id, o.reached, o.state)
                outcome = ItemOutcome.PARTIAL
            progress.append(PrefillProgress(id=o.item.id, outcome=outcome, reached_layer=o.reached, seconds=o.seconds))
        ran = {o.item.id for o in run.outcomes}
        unrun = [it for it in batch.items if it.id not in ran]
        progress += [
            PrefillProgress(id=it.id, outcome=ItemOutcome.PARTIAL, reached_layer=it.from_layer, seconds=0.0)
            for it in unrun
        ]
        await self.bus.publish(
            keys.prefill_reports_stream(self.run),
            PrefillReport(
                run=self.run,
                worker=self.worker,
                batch_id=batch.batch_id,
                progress=tuple(progress),
                preempted=run.preempted,
                at=time.time(),
            ),
        )
        # The snapshots this batch resumed from are not deleted here: the dispatcher deletes them
        # once it accepts this report (`Spent`). This batch may be a stale copy (given up on as
        # lost while this worker paused) whose requests now resume elsewhere from the same state.
        if self.metrics is not None:  # counted once reported (an unreported batch is requeued)
            self.metrics.reported(progress, {o.item.id: o.result.prompt_tokens for o in run.outcomes if o.result})

    async def _answer(self, o: Outcome, res: PrefillResult) -> None:
        now = time.time()
        kv_key, kv_size, expires, note = "", 0, 0.0, "prefill.kv_ttl_s is 0: KV caches are not stored"
        holder = ""
        if self.kv_ttl_s > 0:
            stored = await self.port.put_kv(o.item.id, self.model_name, o.item.tokens, res.token, res.kv, now)
            holder = stored.holder
            if stored.key:
                kv_key, kv_size, expires, note = stored.key, stored.size, now + self.kv_ttl_s, ""
            else:
                note = (
                    f"KV cache budget full: {stored.used} bytes of {stored.budget} (prefill.kv_budget_mb) are held "
                    f"by {self.port.prefill.where}; this {stored.size}-byte cache was not stored"
                )
                self._over_budget(stored)
        prefill_ms = o.seconds * 1000
        await serving.answer(
            self.bus.redis,
            ResultMessage(
                id=o.item.id,
                status=RequestStatus.DONE,
                token=res.token,
                text=res.text,
                logprob=res.logprob,
                top=tuple((t, lp) for t, lp in res.top),
                prompt_tokens=res.prompt_tokens,
                kv_key=kv_key,
                kv_holder=holder,
                kv_bytes=kv_size,
                kv_expires_at=expires,
                kv_note=note,
                worker=self.worker,
                queue_ms=max(0.0, (now - o.item.submitted) * 1000 - prefill_ms),
                prefill_ms=prefill_ms,
                finished=now,
            ),
            o.item.reply_to,
        )

    @property
    def kv_ttl_s(self) -> int:
        return self.port.prefill.kv_ttl_s

    def _over_budget(self, stored: KvStored) -> None:
        """Log the first skipped cache, then at most once a minute with the count since."""
        self._budget_skipped += 1
        t = time.monotonic()
        if t - self._budget_logged >= BUDGET_LOG_EVERY_S:
            log.warning(
                "KV cache budget full: finished prefills answer without a stored KV cache",
                used_bytes=stored.used,
                budget_bytes=stored.budget,
                skipped=self._budget_skipped,
                kv_ttl_s=self.kv_ttl_s,
            )
            self._budget_logged, self._budget_skipped = t, 0
