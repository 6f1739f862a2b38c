"""BubbleTea's dispatcher: queued prefill requests into the training pipeline's bubbles.

A thin shell over the pure `shared/policies/dispatch.py:DispatchState` (a credit book and a waiting
room). The main flow, one request and one bubble:

1. `__main__.py:main` -> `serve.py:serve`: the lease (`lease.py:DispatcherLease.watch`), metrics, heartbeat.
2. `serve.py:lead`: one term as leader: claim what earlier leaders left (`takeover.py:claim`,
   `takeover.py:held_batches`), then the consumers and their handler tables.
3. A request: `dispatcher.py:Dispatcher.on_request` holds it; `Dispatcher.requests_read` hands
   the read to `DispatchState.add_requests` (admission, placement: `shared/policies/refusals.py:on_arrival`).
4. A bubble opens: `dispatcher.py:Dispatcher.on_start`; it ends: `Dispatcher.on_end` (credit back).
5. The fill pass: `shared/policies/handout.py:Handout.fill` packs batches for the roomiest workers.
6. `dispatcher.py:Dispatcher.flush` -> `writes.py:execute`: batches, answers, moves in one round trip
   (`messages.py:batch_message`, `messages.py:answers`), fenced by the lease.
7. A worker's report: `dispatcher.py:Dispatcher.on_report`: answered ids acked, credit released.
8. The timer: `dispatcher.py:Dispatcher.tick` (deadlines, lost batches), `Dispatcher.check_readiness`.
9. `telemetry.py:ControlTelemetry.seen`: what the dispatcher saw, for the run's figures.
10. `serve.py:last_writes`: a stopping leader flushes, hands the lease over and stops its heartbeat.
"""
