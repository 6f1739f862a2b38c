"""Text to token ids and back, without torch (the HTTP front door tokenizes with this).

The served model reads bytes: `ByteTokenizer` maps text to its UTF-8 bytes (ids 0..255), so any
model with ``vocab >= 256`` can read any text. A subword tokenizer (e.g. one backed by HF
`tokenizers`) would be another class beside it satisfying the same `Tokenizer` protocol.
`encode` and `decode` are the byte tokenizer's methods, for callers that need nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

BYTE_VOCAB = 256  # ids 0..255, one per byte value


class Tokenizer(Protocol):
    """What a model's front end needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Ids are in ``0..vocab_size - 1``."""
        ...

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids; `ValueError` for an id outside the vocabulary."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: lossless for any text; stateless, so one instance serves everyone."""

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, as ints in 0..255."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text from byte ids; each invalid UTF-8 sequence becomes U+FFFD (``errors="replace"``).

        `ValueError` for an id outside 0..255 (naming up to five of them).
        """
        values = list(ids)
        bad = [i for i in values if not 0 <= i <= 255]
        if bad:
            raise ValueError(f"byte ids must be in 0..255, got {bad[:5]}")
        return bytes(values).decode("utf-8", errors="replace")


BYTES = ByteTokenizer()
encode = BYTES.encode
decode = BYTES.decode
