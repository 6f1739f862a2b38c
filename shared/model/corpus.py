"""A training corpus of real text, tokenized with a Hugging Face model's own `tokenizer.json`.

`ByteCorpus` (`shared.model.data`) feeds models that read bytes; a Hugging Face model reads the
ids of its own tokenizer, so its training text is tokenized with that tokenizer (the `tokenizers`
library, as the serving side reads it in `shared.model.tokenizer`). `TokenCorpus.from_files`:

* reads local files only, in the order given (nothing is downloaded): a ``.jsonl`` file holds one
  JSON object per non-empty line and the document is its string `field` (default ``"text"``);
  any other file (``.txt``, ``.md``, ...) is one document, read as UTF-8;
* encodes each document without special tokens and packs them into one token stream, with the
  tokenizer's end-of-text token (the first of `EOS_CANDIDATES` its vocabulary has, if any) after
  every document, so the model sees where a document ends and the next begins;
* refuses (`DataError`, one line naming the field, what was found and what is expected) an empty
  list of files, a missing file, a malformed JSONL line, a file with no text, a tokenizer that
  cannot be read, and a tokenizer with more ids than the model's ``vocab_size`` (its ids would
  index past the embedding: the tokenizer is not the model's).

Every microbatch is a pure function of ``(seed, iteration, index)`` and the token stream
(`TokenCorpus.batch`, the same sampling as `ByteCorpus.batch`), drawn with a local generator, so
data-parallel replicas never communicate about data and any process can rebuild any microbatch.
Compare `TokenCorpus.fingerprint()` across processes that must train on the same tokens.

`train_bpe_tokenizer` trains a small byte-level BPE `tokenizer.json` from texts, for tests and
demos that must not download a real model's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor

from shared.model.data import sample_windows

#: End-of-text tokens looked for, in this order, in a tokenizer's vocabulary (GPT-2/Qwen2, Llama 2
#: and Mistral, Llama 3, Gemma): the first one present separates packed documents.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
#: The field of the cluster spec that lists the training files (named in every data error).
DATA_FIELD = "training.data"
#: Extension of files read as one JSON object per line; any other file is one document.
JSONL_SUFFIX = ".jsonl"
#: The special token `train_bpe_tokenizer` adds (id 0) and that separates its documents.
BPE_EOS = "<|endoftext|>"
#: Documents encoded per call to the tokenizer (it encodes a batch in parallel).
_ENCODE_CHUNK = 1024


class DataError(ValueError):
    """Training data cannot be used: one line naming the field, what was found, what is expected."""


def _one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(text).split())


def _kind(value: object) -> str:
    """The JSON name of a decoded JSON value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def load_tokenizer(tokenizer_json: str | Path, vocab: int) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a `tokenizer.json`, checked to fit a model of `vocab` ids.

    `DataError` if the file is missing or unreadable, or if the tokenizer has more ids (added
    tokens included) than the model's vocabulary: its ids would index past the embedding.
    """
    path = Path(tokenizer_json)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise DataError(
            f"tokenizer.json {path} {what} (nothing is downloaded): expected the model's own tokenizer.json file"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a plain Exception for unreadable files
        raise DataError(f"cannot read tokenizer.json {path}: {_one_line(exc)}") from exc
    ids = tok.get_vocab(with_added_tokens=True).values()
    size = max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    if size > vocab:
        raise DataError(
            f"tokenizer.json has {size} tokens but the model's vocab_size is {vocab}: "
            f"the tokenizer does not match the model"
        )
    return tok


def eos_id(tok: Tokenizer) -> int | None:
    """The id of the first of `EOS_CANDIDATES` the tokenizer knows, or None if it has none."""
    for token in EOS_CANDIDATES:
        found = tok.token_to_id(token)
        if found is not None:
            return int(found)
    return None


def _jsonl_documents(path: Path, text: str, field: str) -> Iterator[str]:
    """The string `field` of each non-empty line of a JSONL file's `text`; `DataError` otherwise."""
    expected = f"expected one JSON object per line with a string {field!r} field"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{DATA_FIELD}: {path} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not JSON ({exc.msg}, found {line[:40]!r}): {expected}") from exc
        if not isinstance(obj, dict):
            raise DataError(f"{where} is {_kind(obj)}, not a JSON object: {expected}")
        if field not in obj:
            keys = sorted(obj)[:10]
            raise DataError(f"{where} has no {field!r} field (found keys {keys}): {expected}")
        value = obj[field]
        if not isinstance(value, str):
            raise DataError(f"{where} field {field!r} is {_kind(value)}, not a string: {expected}")
        yield value


def _documents(path: Path, field: str) -> Iterator[str]:
    """The documents of one training file: JSONL lines' `field`, or the whole file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{DATA_FIELD}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise DataError(f"{DATA_FIELD}: cannot read {path}: {_one_line(exc.strerror or exc)}") from exc
    if path.suffix.lower() == JSONL_SUFFIX:
        yield from _jsonl_documents(path, text, field)
    else:
        yield text


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """`items` in lists of at most `size`, in order."""
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_file(tok: Tokenizer, path: Path, field: str, eos: int | None) -> Tensor:
    """One file's documents as int32 ids, `eos` after each non-empty one; `DataError` if none."""
    parts: list[Tensor] = []
    tokens = 0  # document tokens, end-of-text tokens not counted
    for chunk in _chunks(_documents(path, field), _ENCODE_CHUNK):
        for encoding in tok.encode_batch(chunk, add_special_tokens=False):
            ids = encoding.ids
            if not ids:
                continue  # an empty document adds nothing, not even an end-of-text token
            tokens += len(ids)
            parts.append(torch.tensor(ids if eos is None else [*ids, eos], dtype=torch.int32))
    if tokens == 0:
        raise DataError(f"{DATA_FIELD}: {path} yields no tokens: expected a file with at least one non-empty document")
    return torch.cat(parts)


class TokenCorpus:
    """Local text/JSONL files tokenized with a model's own tokenizer.json, packed into one token stream.

    `tokens` is the 1-D stream of every document's ids, documents concatenated (each followed by
    the end-of-text id, `eos`, when the tokenizer has one), stored as int32.
    """

    def __init__(self, tokens: Tensor, eos: int | None = None) -> None:
        if tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"corpus tokens must be a 1-D int32 or int64 tensor, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**31):
            raise ValueError(f"corpus token ids must be in 0..2**31 - 1, got {int(tokens.min())}..{int(tokens.max())}")
        self.tokens = tokens.to(torch.int32).contiguous()
        self.eos = eos

    def __len__(self) -> int:
        """The number of tokens in the stream."""
        return self.tokens.numel()

    @classmethod
    def from_files(
        cls, paths: Sequence[str | Path], tokenizer_json: str | Path, *, vocab: int, field: str = "text"
    ) -> TokenCorpus:
        """The files at `paths`, in that order, tokenized with `tokenizer_json` for a model of `vocab` ids.

        Every path is checked to be an existing file before anything is tokenized, and the
        tokenizer to fit the model (`load_tokenizer`); see the module docstring for the rules.
        """
        if vocab < 1:
            raise ValueError(f"vocab must be >= 1, got {vocab}")
        if not paths:
            raise DataError(f"{DATA_FIELD} is empty: expected a list of local text or JSONL files")
        files = [Path(p) for p in paths]
        for path in files:
            if not path.exists():
                raise DataError(
                    f"{DATA_FIELD}: {path} does not exist (nothing is downloaded): expected a local text or JSONL file"
                )
            if not path.is_file():
                raise DataError(f"{DATA_FIELD}: {path} is not a file: expected a local text or JSONL file")
        tok = load_tokenizer(tokenizer_json, vocab)
        eos = eos_id(tok)
        return cls(torch.cat([_encode_file(tok, path, field, eos) for path in files]), eos=eos)

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the token ids (as little-endian int32): equal means equal streams."""
        return hashlib.sha256(self.tokens.numpy().astype("<i4", copy=False).tobytes()).hexdigest()

    def batch(self, iteration: int, index: int, batch_size: int, seq_len: int, seed: int) -> tuple[Tensor, Tensor]:
        """Microbatch `index` of `iteration`: inputs x and targets y, both int64 (batch_size, seq_len).

        Each row is a random window of the token stream and ``y[:, t] == x[:, t + 1]`` (y is x
        shifted one token ahead). The windows depend only on ``(seed, iteration, index)`` and the
        stream; the global RNG is neither used nor advanced. In pipeline training, microbatch j of
        data-parallel replica d uses ``index = d * microbatches + j``.
        """
        return sample_windows(self.tokens, "tokens", iteration, index, batch_size, seq_len, seed, unit="tokens")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: str | Path) -> Path:
    """Train a byte-level BPE tokenizer on `texts` and save its `tokenizer.json` at `path`.

    GPT-2's scheme: the ByteLevel pre-tokenizer and decoder, all 256 byte symbols in the
    vocabulary (so any text encodes), and `BPE_EOS` as a special token with id 0. `vocab_size`
    counts all of them, so it must be at least 257; the result has fewer ids if the texts allow
    fewer merges. Deterministic: the same texts and `vocab_size` give the same file. Nothing is
    downloaded. Returns `path`.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    least = len(alphabet) + 1
    if vocab_size < least:
        raise ValueError(
            f"vocab_size must be >= {least} (the {len(alphabet)} byte symbols and {BPE_EOS}), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BPE_EOS], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out
