"""The membership room: a worker's slot, its generations, its joins, leaves, stops and saves.

It owns the slot's lease (`lease.py`), the run's recovery generations in Redis (`generations.py`),
one join up to its commit point (`joining.py`), the loop that executes the policy's moves
(`take_part.py`), a drain (`leaving.py`) and `train --save` (`saving.py`). The decisions are
`shared/policies/membership_moves.py`'s; the resume plans `shared/policies/recovery.py`'s.

A worker's membership, step by step:

1. lease a slot: `lease.py:SlotLease.acquire` (or `wait_as_spare`), renewed by `SlotLease.watch`;
2. take part: `take_part.py:take_part` waits, asks `membership_moves.py:next_move`, executes;
3. join: `joining.py:join`: `SlotLease.confirm`, `generations.py:Generations.enter` (the runtime
   reset: `joining.py:reset_runtime`), `Generations.barrier`, `joining.py:_form`,
   `Generations.resume_point`, and the commit point `joining.py:_commit`;
4. train: `take_part.py:_Part.train` runs `StageRunner.run_all`; a save: `saving.py:hand_over_state`;
5. a loss: `SlotLease.watch` sets `peer_lost`, or `Generations.moved` returns: join again (3);
6. the end: `take_part.py:_end`: `SlotLease.finish`, `SlotLease.mark_stopped`,
   `leaving.py:leave_at_boundary` or `leave_now`; a failure raises to `worker.py:serve`.
"""
