"""After prefill ran, off the training path: answer, keep, report, in one round trip to Redis.

Finished requests are answered (first token, logprobs, KV handle; `serving.answer`'s script, first
answer wins) as soon as the run that finished them ends, even when their batch goes on in a later
bubble; a request the model cannot run, or whose saved state expired, is failed with its reason.
When a batch is done (or goes back: no bubble took it in time, or the worker stops), the items it
stopped part way are snapshotted at the layer they reached so any worker of this datacenter can
resume them, and one `PrefillReport` tells the dispatcher where every item got to.

Every tensor is copied into bytes in a thread (the stage port's `keep_prefills`), and an answered
request's tensors are dropped then: its KV cache leaves the device as it is answered, not when its
whole batch reports. The answers and the snapshot handles go to Redis in one pipelined
round trip, then the report in another (a report the dispatcher reads follows its answers); on a
Redis Cluster the first round trip ends with a replica's acknowledgement (`WAIT`,
shared/bus/replicated.py), so no report names answers a master's failover can take back. A
Redis outage (a failover takes seconds) is ridden out (`ride_out`), the recorded writes sent again:
computed answers are not dropped for the dispatcher's lost-batch timeout to requeue. The fill executor acks the
batch only after this, so a worker killed mid-batch leaves it for the dispatcher to requeue.

Tested by: tests/integration/test_kv_budget.py, tests/integration/test_fill_executor.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from redis.asyncio.client import Pipeline

from services.stage_worker.fill.batch import Outcome
from services.stage_worker.metrics import WorkerMetrics
from services.stage_worker.port.stage_port import Cut, Finished, KvStored, StagePort
from shared.bus import Bus
from shared.bus.connection import ride_out
from shared.bus.replicated import replicated
from shared.control import serving
from shared.model.prefill import PrefillResult
from shared.runtime.logs import get_logger
from shared.wire import FIELD, PrefillBatch, PrefillProgress, PrefillReport, encode, keys
from shared.wire import PrefillResult as ResultMessage
from shared.wire.status import ItemOutcome, RequestStatus

log = get_logger(__name__)

#: "KV budget full" is logged at most this often (with how many caches were skipped meanwhile).
BUDGET_LOG_EVERY_S = 60.0


class Recorded:
    """Pipeline commands recorded once and replayed on each try's pipeline: a retry after an
    outage sends the same answers, not answers computed (and their caches kept) again."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    @property
    def pipe(self) -> Pipeline:
        return cast(Pipeline, self)

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))

    def replay(self, pipe: Pipeline) -> None:
        for name, args, kwargs in self.calls:
            getattr(pipe, name)(*args, **kwargs)


@dataclass
class Reporter:
    bus: Bus
    run: str
    worker: str
    model_name: str
    #: Where the KV caches and snapshots go (the stage's port; nothing below it is called here).
    port: StagePort
    metrics: WorkerMetrics | None = None
    #: The datacenter whose dispatcher reads its reports (None: the run's one).
    dispatch_dc: str | None = None
    #: When "KV budget full" was last logged (monotonic), and how many caches were skipped since.
    _budget_logged: float = field(default=-BUDGET_LOG_EVERY_S, repr=False)
    _budget_skipped: int = field(default=0, repr=False)

    async def answer(self, outcomes: list[Outcome]) -> None:
        """Answer these finished outcomes now (their batch goes on): one round trip."""
        answers = Recorded()
        await self._answers(answers.pipe, outcomes)
        await self._write(answers, None, "answers")

    async def finish_batch(self, batch: PrefillBatch, outcomes: list[Outcome], *, preempted: bool) -> None:
        """The batch is done here, or goes back: answer what finished and is not answered yet,
        keep the states of items cut part way, and report every item, in one round trip (two on
        a cluster: the report once a replica holds the rest).
        `outcomes`: every item that started, in order (the rest did not)."""
        cut = [o for o in outcomes if not o.answered and o.state is not None and o.reached > o.item.from_layer]
        fresh = [o for o in outcomes if o.answered and not o.sent]
        answers = Recorded()
        self.port.write_handles(answers.pipe, await self._answers(answers.pipe, fresh, cut=cut))
        progress = [self._progress(o) for o in outcomes]
        ran = {o.item.id for o in outcomes}
        progress += [
            PrefillProgress(id=it.id, outcome=ItemOutcome.PARTIAL, reached_layer=it.from_layer, seconds=0.0)
            for it in batch.items
            if it.id not in ran
        ]

        def report(pipe: Pipeline) -> None:
            msg = PrefillReport(
                run=self.run,
                worker=self.worker,
                batch_id=batch.batch_id,
                progress=tuple(progress),
                preempted=preempted,
                at=time.time(),  # sent now: what comes before (the caches' and states' bytes) is not the hop
            )
            pipe.xadd(keys.prefill_reports_stream(self.run, self.dispatch_dc), {FIELD: encode(msg)})

        await self._write(answers, report, f"answers and report of batch {batch.batch_id}")
        # The snapshots this batch resumed from are not deleted here: the dispatcher deletes them
        # once it accepts this report (`Spent`). This batch may be a stale copy (given up on as
        # lost while this worker paused) whose requests now resume elsewhere from the same state.
        if self.metrics is not None:  # counted once reported (an unreported batch is requeued)
            tokens = {o.item.id: o.result.prompt_tokens for o in outcomes if o.result}
            self.metrics.reported(progress, tokens)

    async def _write(self, answers: Recorded, report: Callable[[Pipeline], None] | None, what: str) -> None:
        """The recorded answers and saved states, then (`report`) the report naming them, held by a
        replica in between on a cluster (a dispatcher never acts on answers a failover can take
        back). Through an outage (a master's failover: seconds) it is retried, not dropped: the
        answers are computed, and every write here may land twice (the first answer wins; a report
        read twice changes nothing the second time)."""
        key = keys.prefill_reports_stream(self.run, self.dispatch_dc)
        await ride_out(lambda: replicated(self.bus.redis, key, answers.replay, what, then=report), what)

    def _progress(self, o: Outcome) -> PrefillProgress:
        outcome = ItemOutcome.DONE if o.result is not None else ItemOutcome.FAILED if o.failure else ItemOutcome.PARTIAL
        started = -1 if o.started is None else o.started
        return PrefillProgress(
            id=o.item.id,
            outcome=outcome,
            reached_layer=o.reached,
            seconds=o.seconds,
            started_layer=started,
            answered_at=o.answered_at,
        )

    async def _answers(
        self, pipe: Pipeline, outcomes: list[Outcome], *, cut: list[Outcome] | None = None
    ) -> list[tuple[str, str]]:
        """Queue on `pipe` the answers of `outcomes` (their KV caches kept first) and mark them
        sent; keep the states of `cut`. Returns the snapshot handles to write."""
        for o in outcomes:
            await o.read()
        now = time.time()
        done = [o for o in outcomes if o.result is not None]
        finished = [Finished(o.item.id, o.item.tokens, o.result.token, o.result.kv) for o in done if o.result]
        kept = finished if self.port.prefill.kv_ttl_s > 0 else []
        states = [Cut(o.item.id, o.state) for o in cut or [] if o.state is not None]
        stored, handles = (
            await self.port.keep_prefills(self.model_name, kept, states, now) if kept or states else ({}, [])
        )
        for o in outcomes:
            if o.result is not None:
                self._queue_answer(pipe, o, o.result, stored.get(o.item.id), now)
            elif o.failure is not None:
                reason, why = o.failure
                failed = ResultMessage(
                    id=o.item.id,
                    status=RequestStatus.FAILED,
                    reason=reason,
                    error=why,
                    worker=self.worker,
                    finished=now,
                )
                serving.queue_answer(pipe, self.run, failed, o.item.reply_to, dc=self.dispatch_dc)
            o.sent = True
            o.answered_at = o.answered_at or now
            # answered: its tensors leave the device now (the KV cache is bytes, kept above), not at the batch's end
            o.state = None
            if o.result is not None:
                o.result = replace(o.result, kv=[])
        return handles

    def _queue_answer(
        self, pipe: Pipeline, o: Outcome, res: PrefillResult, stored: KvStored | None, now: float
    ) -> None:
        kv_key, kv_size, expires, note, holder = "", 0, 0.0, "prefill.kv_ttl_s is 0: KV caches are not stored", ""
        kv_ttl_s = self.port.prefill.kv_ttl_s
        if stored is not None:
            holder = stored.holder
            if stored.key:
                kv_key, kv_size, expires, note = stored.key, stored.size, now + kv_ttl_s, ""
            else:
                note = (
                    f"KV cache budget full: {stored.used} bytes of {stored.budget} (prefill.kv_budget_mb) are held "
                    f"by {self.port.prefill.where}; this {stored.size}-byte cache was not stored"
                )
                self._over_budget(stored)
        prefill_ms = o.seconds * 1000
        result = ResultMessage(
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
        )
        serving.queue_answer(pipe, self.run, result, o.item.reply_to, dc=self.dispatch_dc)

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
                kv_ttl_s=self.port.prefill.kv_ttl_s,
            )
            self._budget_logged, self._budget_skipped = t, 0
