"""What a consumer hands its handlers, and how it picks one: the handler table.

Each consumer is built with one table, `{message kind: handler}`, declared where the service
wires its streams (Cosmic Python's handler table, msgspec's `match` over a union): the table is
the one readable place that says what a stream carries. A message of any other kind is
dead-lettered by the consumer, with a reason that names the stream, the kind it got and the kinds
it takes; handlers never check types themselves.

A handler's return value says what happens to the entry: `None` acks it (the effect happened);
`HOLD` keeps it pending, owned by this consumer, until the service calls `Consumer.release`
(e.g. a request is acked only once it has been answered, without parking a task per request).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from shared.wire import Message, kind_of


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a message to a handler. `attempt` is 1 on first delivery."""

    id: str
    stream: str
    message: Message
    attempt: int


class Outcome(enum.Enum):
    """What a handler asks of its entry besides the default (ack on return)."""

    HOLD = "hold"  # stay pending, owned by this consumer, until `Consumer.release(id)`


HOLD = Outcome.HOLD

Handler = Callable[[Delivery], Awaitable[Outcome | None]]
#: A consumer's handler table: the message kinds its stream carries, each with its handler.
Handlers = Mapping[type[Message], Handler]


class Reject(Exception):
    """Raised by a handler for a message that can never succeed (e.g. it names an unknown link):
    the bus dead-letters it at once instead of retrying it `max_deliveries` times."""


def route(handlers: Handlers, stream: str, msg: Message) -> Handler:
    """The handler for `msg`, or `Reject` naming the stream, the kind and the kinds it takes."""
    handler = handlers.get(type(msg))
    if handler is None:
        takes = ", ".join(sorted(kind_of_type(t) for t in handlers)) or "nothing"
        raise Reject(f"stream {stream} takes {takes}; got kind {kind_of(msg)!r}")
    return handler


def kind_of_type(cls: type[Message]) -> str:
    """The kind tag of a message class, e.g. ``"ping"``."""
    return str(cls.__struct_config__.tag)
