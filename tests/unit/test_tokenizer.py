"""The torch-free byte tokenizer: lossless round trips, and exactly the behaviour it had in `data.py`."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from shared.model.tokenizer import BYTES, ByteTokenizer, Tokenizer, decode, encode

TEXTS = ["", "Hello, world", "naïve café", "日本語", "emoji 🫖 tea", "tab\tnew\nline\x00nul"]


def old_encode(text: str) -> list[int]:
    """`shared.model.data.encode` as it was before the tokenizer moved."""
    return list(text.encode("utf-8"))


def old_decode(ids: Iterable[int]) -> str:
    """`shared.model.data.decode` as it was before the tokenizer moved (ints only)."""
    values = list(ids)
    bad = [i for i in values if not 0 <= i <= 255]
    if bad:
        raise ValueError(f"byte ids must be in 0..255, got {bad[:5]}")
    return bytes(values).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_matches_the_old_tokenizer(text: str) -> None:
    ids = encode(text)
    assert ids == old_encode(text) and all(0 <= i <= 255 for i in ids)
    assert decode(ids) == old_decode(ids) == text


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"\xff", "\ufffd"),  # never valid in UTF-8
        (b"\xc3", "\ufffd"),  # a 2-byte sequence cut short
        (b"\xe2\x82", "\ufffd"),  # a 3-byte sequence cut short: one replacement for the prefix
        (b"\xf0\x9f\x98", "\ufffd"),  # an emoji's first 3 of 4 bytes
        (b"\xc0\xaf", "\ufffd\ufffd"),  # overlong encoding of "/": each byte replaced
        (b"\xed\xa0\x80", "\ufffd" * 3),  # an encoded surrogate
        (b"a\xffb\xe2\x82\xac", "a\ufffdb\u20ac"),  # valid text around an invalid byte survives
    ],
)
def test_invalid_utf8_decodes_as_before(raw: bytes, text: str) -> None:
    assert decode(list(raw)) == old_decode(list(raw)) == text


def test_decode_takes_any_iterable_of_ints() -> None:
    ids = encode("héllo")
    assert decode(iter(ids)) == decode(tuple(ids)) == decode(b"h\xc3\xa9llo") == "héllo"
    assert decode(i for i in ids) == "héllo"
    assert decode(range(97, 100)) == "abc"


@pytest.mark.parametrize("ids", [[256], [-1], [104, 300, 105]])
def test_ids_outside_a_byte_are_refused(ids: list[int]) -> None:
    with pytest.raises(ValueError, match=r"byte ids must be in 0\.\.255"):
        decode(ids)


def test_byte_tokenizer_is_a_tokenizer() -> None:
    tok: Tokenizer = ByteTokenizer()
    assert tok.vocab_size == BYTES.vocab_size == 256
    assert tok.encode("hi") == encode("hi") == [104, 105] and tok.decode([104, 105]) == "hi"


def test_data_decode_still_takes_a_tensor() -> None:
    import torch  # here, not at the top: the rest of this file is torch-free like the tokenizer

    from shared.model import data

    ids = encode("naïve")
    assert data.encode("naïve") == ids
    assert data.decode(torch.tensor(ids)) == data.decode(ids) == "naïve"
    with pytest.raises(ValueError):
        data.decode(torch.tensor([256]))
