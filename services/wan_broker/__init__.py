"""The Atlas slot arbiter and WAN emulator.

The main flow:

1. `__main__.py:main` -> `broker.py:serve`: one driver per directed DC link of the spec
   (`broker.py:directed_links`), each over the same link model as the analytic model's.
2. WAN mode `kernel` or `none`: `grants.py:SlotDriver.on_request` grants a slot as the
   `shared/policies/wan.py` sharing policy decides; the worker moves the bytes itself and reports
   `grants.py:SlotDriver.on_done`; `SlotDriver.expire` takes back a slot whose holder went silent.
3. WAN mode `model`: `links.py:LinkDriver.carry` delivers a `Transfer` when the policy says it is done.
4. `broker.py:_report` and `metrics.py:BrokerMetrics.refresh`: each link's grants and bytes.
"""
