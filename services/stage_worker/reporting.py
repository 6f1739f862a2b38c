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
from dataclasses import dataclass

from services.stage_worker.metrics import WorkerMetrics
from shared import keys, kvstore, serving
from shared.bus import Bus
from shared.model.prefill import PrefillResult, PrefillState
from shared.status import FailureReason, ItemOutcome, RequestStatus
from shared.wire import PrefillBatch, PrefillItem, PrefillProgress, PrefillReport
from shared.wire import PrefillResult as ResultMessage


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
    kv_ttl_s: int
    metrics: WorkerMetrics | None = None

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
                    key = keys.prefill_snapshot_key(self.run, o.item.id, o.reached)
                    await kvstore.save_snapshot(r, key, kvstore.snapshot(o.item.id, o.state))
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
            ),
        )
        if self.metrics is not None:  # counted once reported (an unreported batch is requeued)
            self.metrics.reported(progress, {o.item.id: o.result.prompt_tokens for o in run.outcomes if o.result})

    async def _answer(self, o: Outcome, res: PrefillResult) -> None:
        now = time.time()
        kv_key, kv_size, expires = "", 0, 0.0
        if self.kv_ttl_s > 0:
            data = kvstore.kv_file(o.item.id, self.model_name, o.item.tokens, res.token, res.kv)
            kv_key, kv_size = await kvstore.store_kv(self.bus.redis, o.item.id, data, self.kv_ttl_s)
            expires = now + self.kv_ttl_s
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
                kv_bytes=kv_size,
                kv_expires_at=expires,
                worker=self.worker,
                queue_ms=max(0.0, (now - o.item.submitted) * 1000 - prefill_ms),
                prefill_ms=prefill_ms,
                finished=now,
            ),
            o.item.reply_to,
        )
