"""The wire format: every message kind as a typed class with one msgpack encoding.

One encoder and one decoder per process, reused (msgspec builds them once). A message on a
stream is a single field, `m`, holding the msgpack bytes of one of the kinds. Each encoded message
carries its kind (the tagged-union tag, field ``kind``) and the wire version (field ``v``).
Decoding anything that is not a known kind at the current version raises `WireError`; the bus
dead-letters such entries instead of half-handling them.

The kinds live by plane: `base` (the base class, `TensorBlob`, `Ping`/`Pong`), `training` and
`serving`; this module is the wire's one index: the union of every kind, and `encode`/`decode`.
Every stream name and key prefix is in `keys`, every status in `status`.
Tensors travel as dtype + shape + raw bytes (`shared.dataplane.tensors`), never pickle.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from shared.wire.base import FIELD as FIELD
from shared.wire.base import WIRE_VERSION as WIRE_VERSION
from shared.wire.base import Message as Message
from shared.wire.base import Ping as Ping
from shared.wire.base import Pong as Pong
from shared.wire.base import TensorBlob as TensorBlob
from shared.wire.base import WireError as WireError
from shared.wire.serving import DecodeChunk as DecodeChunk
from shared.wire.serving import DecodeRequest as DecodeRequest
from shared.wire.serving import PrefillBatch as PrefillBatch
from shared.wire.serving import PrefillItem as PrefillItem
from shared.wire.serving import PrefillProgress as PrefillProgress
from shared.wire.serving import PrefillReport as PrefillReport
from shared.wire.serving import PrefillRequest as PrefillRequest
from shared.wire.serving import PrefillResult as PrefillResult
from shared.wire.serving import PrefillSnapshot as PrefillSnapshot
from shared.wire.training import BubbleEnd as BubbleEnd
from shared.wire.training import BubbleStart as BubbleStart
from shared.wire.training import ControlSeen as ControlSeen
from shared.wire.training import IterationDone as IterationDone
from shared.wire.training import LinkReport as LinkReport
from shared.wire.training import PrefillOff as PrefillOff
from shared.wire.training import SlotDone as SlotDone
from shared.wire.training import SlotGrant as SlotGrant
from shared.wire.training import SlotRequest as SlotRequest
from shared.wire.training import SpanRecord as SpanRecord
from shared.wire.training import TensorReady as TensorReady
from shared.wire.training import Transfer as Transfer
from shared.wire.training import WorkerFailed as WorkerFailed
from shared.wire.training import WorkerJoined as WorkerJoined

#: Every kind the bus can carry. New kinds are added here, so this union is the wire's index.
AnyMessage = (
    Ping
    | Pong
    | TensorReady
    | Transfer
    | SlotRequest
    | SlotGrant
    | SlotDone
    | BubbleStart
    | WorkerJoined
    | BubbleEnd
    | PrefillOff
    | SpanRecord
    | ControlSeen
    | IterationDone
    | WorkerFailed
    | LinkReport
    | PrefillRequest
    | PrefillResult
    | PrefillBatch
    | PrefillReport
    | PrefillSnapshot
    | DecodeRequest
    | DecodeChunk
)

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    """The one msgpack encoding of a message."""
    return _encoder.encode(msg)


def decode(data: bytes | None) -> Message:
    """Decode bytes from the wire; raises `WireError` naming what is wrong."""
    if not data:
        raise WireError("empty message (no payload in field 'm')")
    try:
        msg: Message = _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass: unknown kind, bad field
        raise WireError(f"malformed message: {exc}") from exc
    if msg.v != WIRE_VERSION:
        raise WireError(
            f"unsupported wire version {msg.v} for kind {kind_of(msg)!r}; this peer speaks version {WIRE_VERSION}"
        )
    return msg


def kind_of(msg: Message) -> str:
    """The kind tag of a message, e.g. ``"ping"``; used in logs and metrics."""
    tag: Any = msg.__struct_config__.tag
    return str(tag)
