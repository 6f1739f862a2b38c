import msgspec
import pytest
import torch

from shared.dataplane.tensors import TensorBlob, from_blob, to_blob
from shared.wire import WireError


def wire_round_trip(t: torch.Tensor) -> torch.Tensor:
    """Through the codec and a real msgpack encoding, as it travels on the bus."""
    raw = msgspec.msgpack.encode(to_blob(t))
    return from_blob(msgspec.msgpack.decode(raw, type=TensorBlob))


def bits(t: torch.Tensor) -> bytes:
    return to_blob(t).data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_float_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 5, 7, generator=g).to(dtype)
    t[0, 0, 0] = float("nan")
    t[0, 0, 1] = float("inf")
    t[0, 0, 2] = -0.0
    back = wire_round_trip(t)
    assert back.dtype == dtype and back.shape == t.shape
    assert bits(back) == bits(t)  # exact, including NaN payload and the sign of zero


def test_int_and_bool_round_trip() -> None:
    t = torch.tensor([[-(2**63), 2**63 - 1], [0, 42]], dtype=torch.int64)
    assert torch.equal(wire_round_trip(t), t)
    b = torch.tensor([True, False, True])
    assert torch.equal(wire_round_trip(b), b)


def test_non_contiguous_scalar_and_empty() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not t.is_contiguous()
    assert torch.equal(wire_round_trip(t), t)
    s = torch.tensor(3.5, dtype=torch.bfloat16)
    assert wire_round_trip(s).shape == () and wire_round_trip(s).item() == 3.5
    e = torch.empty(0, 4, dtype=torch.int64)
    assert wire_round_trip(e).shape == (0, 4)


def test_result_owns_its_memory() -> None:
    blob = to_blob(torch.ones(4))
    t = from_blob(blob)
    t += 1  # writable, and does not alias the message bytes
    assert from_blob(blob).sum().item() == 4


def test_gradient_tensor_is_detached() -> None:
    t = torch.ones(2, requires_grad=True) * 2
    assert not wire_round_trip(t).requires_grad


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (TensorBlob("complex64", (1,), b"\0" * 8), "unknown tensor dtype"),
        (TensorBlob("float32", (2, 2), b"\0" * 15), "needs 16 bytes, got 15"),
        (TensorBlob("float32", (-1,), b""), "negative dimension"),
    ],
)
def test_inconsistent_blobs_are_refused(blob: TensorBlob, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        from_blob(blob)


def test_unsupported_dtype_cannot_be_sent() -> None:
    with pytest.raises(WireError, match="cannot go on the wire"):
        to_blob(torch.zeros(2, dtype=torch.complex64))
