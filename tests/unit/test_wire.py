import msgspec
import pytest

from shared.wire import WIRE_VERSION, Ping, Pong, WireError, decode, encode, kind_of


def test_round_trip_keeps_type_and_fields() -> None:
    msg = Ping(seq=3, sent_ns=123456789, reply_to="bt:pong")
    back = decode(encode(msg))
    assert back == msg and type(back) is Ping
    assert kind_of(back) == "ping"
    assert decode(encode(Pong(seq=1, sent_ns=2))) == Pong(seq=1, sent_ns=2)


def test_encoding_carries_kind_and_version() -> None:
    raw = msgspec.msgpack.decode(encode(Ping(seq=1, sent_ns=2)))
    assert raw["kind"] == "ping" and raw["v"] == WIRE_VERSION


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (None, "empty message"),
        (b"", "empty message"),
        (b"\xc1", "malformed"),  # 0xc1 is never valid msgpack
        (msgspec.msgpack.encode({"kind": "nope", "v": 1}), "malformed"),
        (msgspec.msgpack.encode({"v": 1, "seq": 1, "sent_ns": 2}), "malformed"),
        (msgspec.msgpack.encode({"kind": "ping", "v": 1, "seq": "x", "sent_ns": 2}), "malformed"),
        (msgspec.msgpack.encode({"kind": "ping", "v": 1, "sent_ns": 2}), "malformed"),
        (encode(Ping(seq=1, sent_ns=2))[:-2], "malformed"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
    ],
)
def test_bad_bytes_raise_one_error(payload: bytes | None, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode(payload)


def test_other_wire_version_is_refused() -> None:
    raw = msgspec.msgpack.encode({"kind": "ping", "v": WIRE_VERSION + 1, "seq": 1, "sent_ns": 2})
    with pytest.raises(WireError, match=f"unsupported wire version {WIRE_VERSION + 1}"):
        decode(raw)


def test_messages_are_immutable() -> None:
    with pytest.raises(AttributeError):
        Ping(seq=1, sent_ns=2).seq = 5  # type: ignore[misc]
