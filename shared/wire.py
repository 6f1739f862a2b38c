"""The wire format: every message kind as a typed class with one msgpack encoding.

One encoder and one decoder per process, reused (msgspec builds them once). A message on a
stream is a single field, `m`, holding the msgpack bytes of one of the classes below. Each
encoded message carries its kind (the tagged-union tag, field ``kind``) and the wire version
(field ``v``). Decoding anything that is not a known kind at the current version raises
`WireError`; the bus dead-letters such entries instead of half-handling them.

Tensors travel as dtype + shape + raw bytes (`shared.tensors.TensorBlob`), never pickle.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

#: Bump when a message changes incompatibly; peers at another version are refused loudly.
WIRE_VERSION: Final = 1

#: The stream entry field that holds the encoded message.
FIELD: Final = b"m"


class WireError(ValueError):
    """Bytes that are not a valid message of a known kind at this wire version."""


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


#: Every kind the bus can carry. New kinds are added here, so this union is the wire's index.
AnyMessage = Ping | Pong

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
