"""Text to token ids and back, without torch (the HTTP front door tokenizes with this).

Two tokenizers satisfy the `Tokenizer` protocol:

* `ByteTokenizer`: text as its UTF-8 bytes (ids 0..255), so any model with ``vocab >= 256`` can
  read any text. The seeded and trained nanoGPT read bytes.
* `HFTokenizer`: a Hugging Face checkpoint's `tokenizer.json`, run by the `tokenizers` library
  (Rust, no torch). `encode` applies the tokenizer's own post-processor, so special tokens are
  added exactly when the checkpoint's tokenizer adds them (e.g. Llama's BOS; GPT-2 and Qwen2 add
  none), as ``tokenizer(text)`` in transformers does; `decode` skips special tokens, as vLLM does
  by default, so the text of an end-of-sequence token is "".

`tokenizer_for(prefill_spec)` picks the one the served model reads. `encode` and `decode` are the
byte tokenizer's methods, for callers that need nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _RustTokenizer

from shared.config.model_info import CheckpointError
from shared.config.spec import Prefill
from shared.model.shape import is_checkpoint_dir

BYTE_VOCAB = 256  # ids 0..255, one per byte value
#: The tokenizer file of a Hugging Face checkpoint directory.
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    """What a model's front end needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Ids are in ``0..vocab_size - 1``."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`; `add_special_tokens=False` leaves out those the tokenizer adds
        (text rendered by a chat template already holds them)."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids; `ValueError` for an id outside the vocabulary."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: lossless for any text; stateless, so one instance serves everyone."""

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The UTF-8 bytes of `text`, as ints in 0..255 (bytes have no special tokens to add)."""
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


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (any model the `tokenizers` library reads).

    `vocab_size` is one more than the largest id it knows, added tokens included. `encode` adds
    special tokens only where the file's post-processor says so; `decode` drops special tokens
    and refuses (`ValueError`) an id outside ``0..vocab_size - 1``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._tok = _RustTokenizer.from_file(str(self.path))
        except Exception as exc:  # the library raises a plain Exception for unreadable files
            raise CheckpointError(f"cannot read tokenizer {self.path}: {exc}") from exc
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise CheckpointError(f"tokenizer {self.path} has an empty vocabulary")
        self._vocab_size = max(vocab.values()) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the special tokens the tokenizer's post-processor adds (unless
        `add_special_tokens` is false)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens skipped. An id the tokenizer does not have (a model's
        embedding is often padded past its tokenizer, and a model may generate such an id) is
        U+FFFD, as `token_text` shows it, rather than an error in the middle of a completion."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if 0 <= i < self._vocab_size:
                run.append(i)
                continue
            if run:
                out.append(str(self._tok.decode(run, skip_special_tokens=True)))
                run = []
            out.append("\ufffd")
        if run:
            out.append(str(self._tok.decode(run, skip_special_tokens=True)))
        return "".join(out)


BYTES = ByteTokenizer()
encode = BYTES.encode
decode = BYTES.decode


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """The text of one generated token: U+FFFD for an id the tokenizer does not know (a model's
    vocabulary may be larger than its tokenizer's, e.g. padded embeddings, or vocab > 256 bytes)."""
    return tokenizer.decode([token]) if 0 <= token < tokenizer.vocab_size else "\ufffd"


def tokenizer_for(spec: Prefill) -> Tokenizer:
    """The tokenizer of the model a spec's `prefill` section serves.

    A `checkpoint` directory: its `tokenizer.json` (`CheckpointError`, a `ValueError`, naming the
    file if it is missing). Otherwise (seeded nanoGPT or a nanoGPT state_dict file): bytes.
    """
    if is_checkpoint_dir(spec):
        assert spec.checkpoint is not None
        path = Path(spec.checkpoint) / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint directory {spec.checkpoint} has no {TOKENIZER_FILE}: the served text is "
                f"tokenized with the checkpoint's own tokenizer (the fast tokenizer file; "
                f"tokenizer.model/vocab.json alone are not read)"
            )
        return HFTokenizer(path)
    return BYTES


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop sequence starts in `text`, and which (None if none occurs)."""
    found = [(text.find(s), s) for s in stops if s and s in text]
    return min(found) if found else None
