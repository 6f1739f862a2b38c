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


def test_every_training_message_round_trips() -> None:
    import torch

    from shared.dataplane.tensors import from_blob, to_blob
    from shared.wire import (
        BubbleEnd,
        BubbleStart,
        IterationDone,
        LinkReport,
        PrefillOff,
        PrefillSnapshot,
        SlotDone,
        SlotGrant,
        SlotRequest,
        SpanRecord,
        TensorReady,
        Transfer,
        WorkerFailed,
        WorkerJoined,
    )

    t = to_blob(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    msgs = [
        PrefillSnapshot(id="q", tokens=(1, 2), next_layer=1, hidden=t, kv=((t, t),)),
        TensorReady(
            run="r",
            what="act",
            iteration=1,
            microbatch=2,
            replica=0,
            src_stage=0,
            dst_stage=1,
            dtype="float32",
            shape=(2, 3),
            generation=4,
            hold=True,
        ),
        SlotRequest(
            run="r",
            transfer_id="x",
            src_dc="a",
            dst_dc="b",
            nbytes=10,
            priority=(1, 2, 0),
            microbatch=2,
            what="act",
            reply_to="s",
            sent_at=1.5,
        ),
        SlotGrant(run="r", transfer_id="x", why="temporal: link free"),
        SlotDone(run="r", transfer_id="x", src_dc="a", dst_dc="b", seconds=0.25),
        Transfer(
            run="r",
            transfer_id="x",
            src_dc="a",
            dst_dc="b",
            nbytes=10,
            priority=(1, 2, 0),
            deliver_to="s",
            payload=b"\x00\x01",
        ),
        BubbleStart(
            run="r",
            worker="r0s1",
            replica=0,
            stage=1,
            dc="b",
            iteration=0,
            position=0,
            predicted_ms=1.5,
            free_memory_bytes=1 << 30,
            at=1.0,
        ),
        WorkerJoined(
            run="r", worker="r0s1", replica=0, stage=1, typical_bubble_ms=12.5, free_memory_bytes=1 << 30, at=0.5
        ),
        BubbleEnd(
            run="r", worker="r0s1", replica=0, stage=1, iteration=0, position=0, predicted_ms=1.5, actual_ms=2.0, at=2.0
        ),
        PrefillOff(run="r", worker="r0s1", reason="prefill failed in 3 batches in a row", at=3.0),
        SpanRecord(run="r", replica=0, stage=1, iteration=0, span="fwd", start=1.0, end=2.0, microbatch=3),
        IterationDone(run="r", replica=0, stage=1, iteration=0, started=0.0, ended=1.0, loss=5.5),
        WorkerFailed(run="r", slot="r0s1", reason="lease lost"),
        LinkReport(
            run="r", src_dc="a", dst_dc="b", utilization=0.5, bytes_sent=1e6, transfers=3, in_flight=1, late_p99_ms=0.4
        ),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
    back = decode(encode(msgs[0]))
    assert isinstance(back, PrefillSnapshot)
    assert torch.equal(from_blob(back.hidden), torch.arange(6, dtype=torch.float32).reshape(2, 3))
