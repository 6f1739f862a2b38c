"""The stage worker: one pipeline stage of one replica, training as the owner, prefill as the guest.

Rooms: `train/` (the stage's model and its schedule), `fill/` (prefill in the bubbles), `port/`
(every tensor in and out), `membership/` (the slot, its peers, recovery); at the top the shell:
`worker.py` (the composition root), `metrics.py`, `telemetry.py`, `chaos.py`.

One training step, the main flow:

1. `__main__.py:main` -> `worker.py:serve`: lease a slot (`SlotLease.acquire`), start health and metrics.
2. `worker.py:_train`: build the stage (`_trainer`, `train/timing.py:profile_and_prior`, `_runner`,
   `port/stage_port.py:build_port`, with BubbleTea `_start_fill`).
3. `membership/take_part.py:take_part`: join a generation, form the data plane, then `StageRunner.run_all`.
4. `train/runner.py:StageRunner._iteration`: walk the slot's schedule (`shared/policies/walk.py`).
5. FWD / BWD: `train/trainer.py:StageTrainer.forward` / `.backward`, in the torch thread (`_compute`).
6. SEND: `port/stage_port.py:StagePort.send` -> `port/transport.py:Transport.send` (data plane + `TensorReady`).
7. RECV: `port/transport.py:Transport.on_ready` -> `port/mailbox.py:Mailbox.put`; `StageRunner._recv`
   takes it, or waits in a bubble (`fill/announcer.py:BubbleAnnouncer.wait`).
8. `StageRunner._allreduce`, `._collectives` (a bubble too), then `StageTrainer.step`.
9. `StageRunner._report`: `IterationDone` on the outbox (`port/outbox.py`); a checkpoint when due.
10. `worker.py:_close`: the stage closed in the reverse order of its set-up.

One bubble's fill:

1. `fill/executor.py:Filler.on_batch`: a `PrefillBatch` joins the queue (`shared/policies/fill.py:FillQueue`).
2. `fill/announcer.py:BubbleAnnouncer.wait`: `BubbleStart` out, with what this worker holds.
3. `fill/executor.py:Filler.fill`: run the queue's head until training's input arrives.
4. `fill/executor.py:Filler._run`: its first block in the event loop, the rest in the prefill thread.
5. `fill/compute.py:BatchCompute.steps` -> `._next_item` -> `._run_blocks`, each block if the fit
   rule lets it start (`shared/policies/fill.py:may_start`); progress kept in `fill/batch.py:Queued`.
6. Each request answered as it is done: `fill/answers.py:Answers.callback` -> `fill/reporting.py:Reporter.answer`.
7. A failed request: `fill/guest_faults.py:Guest.failed`; a batch's end `Guest.batch_ended`.
8. A batch done or handed back: `fill/executor.py:Filler._finish` -> `fill/reporting.py:Reporter.finish_batch`
   (KV caches and snapshots through `port/stage_port.py:StagePort.keep_prefills`), then acked.
9. The input arrived: `BubbleAnnouncer.wait` sends `BubbleEnd` (the batches finished in it).
10. `fill/executor.py:Filler.close`: what is held goes back to the dispatcher as the worker stops.
"""
