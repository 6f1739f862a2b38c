"""The Redis Streams bus: typed publish, consumer groups, reclaim, dead letters, drain.

See docs/architecture.md ("The bus") for the delivery contract and why it is hand-written over
redis.asyncio rather than taken from a framework.
"""

from shared.bus.bus import Bus, default_consumer_name
from shared.bus.consumer import Consumer, ConsumerStats
from shared.bus.deadletters import DeadLetter
from shared.bus.delivery import HOLD, Delivery, Handler, Handlers, Outcome, Reject
from shared.bus.streams import trim_acked

__all__ = [
    "HOLD",
    "Bus",
    "Consumer",
    "ConsumerStats",
    "DeadLetter",
    "Delivery",
    "Handler",
    "Handlers",
    "Outcome",
    "Reject",
    "default_consumer_name",
    "trim_acked",
]
