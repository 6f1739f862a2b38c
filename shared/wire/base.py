"""The wire's base: the message base class, the tensor blob, the version, liveness probes.

Every message kind derives from `Message` (a msgspec tagged union: field ``kind`` is the tag, ``v``
the wire version). The kinds themselves live by plane (`shared.wire.training`,
`shared.wire.serving`); the union of all of them and the one encoder and decoder are in
`shared.wire` (the package), the wire's index.
"""

from __future__ import annotations

from typing import Final

import msgspec

#: Bump when a message changes incompatibly; peers at another version are refused loudly.
#: 2: statuses are enums (`shared.wire.status`); unread batch/report timing fields removed.
WIRE_VERSION: Final = 2

#: The stream entry field that holds the encoded message.
FIELD: Final = b"m"


class WireError(ValueError):
    """Bytes that are not a valid message of a known kind at this wire version."""


class TensorBlob(msgspec.Struct, frozen=True, array_like=True):
    """A tensor as it travels: dtype name, shape, and the row-major bytes of its elements.
    Built and read by `shared.dataplane.tensors` (`to_blob`, `from_blob`)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every message kind. Subclasses set ``tag=`` to their stable kind name."""

    v: int = WIRE_VERSION


class Ping(Message, frozen=True, kw_only=True, tag="ping"):
    """Liveness / latency probe: a consumer answers with a `Pong` carrying the same fields."""

    seq: int
    sent_ns: int
    reply_to: str = ""


class Pong(Message, frozen=True, kw_only=True, tag="pong"):
    seq: int
    sent_ns: int
