"""The torch-free tokenizers: the byte tokenizer (lossless, exactly the behaviour it had in `data.py`)
and a Hugging Face `tokenizer.json` (round trips, specials only where its post-processor adds them)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from shared.config.model_info import CheckpointError
from shared.config.spec import Prefill
from shared.model.tokenizer import (
    BYTES,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    decode,
    encode,
    token_text,
    tokenizer_for,
)

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


# --- a Hugging Face tokenizer.json ----------------------------------------------------------------


def byte_bpe(path: Path, *, bos: bool = False) -> Path:
    """A byte-level BPE tokenizer.json (GPT-2's scheme: 256 byte symbols, two specials, a few merges);
    with `bos`, a post-processor that puts `<s>` before every text (as Llama's does)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path))
    return path


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_hf_tokenizer_round_trips_any_text(tmp_path: Path, text: str) -> None:
    tok: Tokenizer = HFTokenizer(byte_bpe(tmp_path / "tokenizer.json"))
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_hf_tokenizer_merges_adds_only_the_post_processors_specials_and_skips_them(tmp_path: Path) -> None:
    plain = HFTokenizer(byte_bpe(tmp_path / "plain.json"))
    assert plain.vocab_size == 280
    ids = plain.encode("the quick brown fox")
    assert len(ids) < len("the quick brown fox")  # merges learnt from the corpus are used
    assert 0 not in ids and 1 not in ids  # GPT-2 style: no special token is added
    with_bos = HFTokenizer(byte_bpe(tmp_path / "bos.json", bos=True))
    assert with_bos.encode("the quick brown fox") == [0, *ids]  # the file's post-processor adds <s>
    assert with_bos.decode([0, *ids, 1]) == "the quick brown fox"  # specials are skipped on decode
    assert token_text(plain, 1) == ""  # the text of an end-of-sequence token
    assert token_text(plain, 280) == token_text(BYTES, 256) == "\ufffd"  # an id beyond the tokenizer
    assert token_text(BYTES, 104) == "h"
    # ids past the tokenizer (a padded embedding can generate them) read as U+FFFD, in place
    assert plain.decode([*ids, 280, -1, *ids]) == "the quick brown fox\ufffd\ufffdthe quick brown fox"


def test_tokenizer_for_a_spec(tmp_path: Path) -> None:
    assert tokenizer_for(Prefill()) is BYTES  # seeded nanoGPT
    assert tokenizer_for(Prefill(checkpoint=str(tmp_path / "model.pt"))) is BYTES  # a state_dict file
    directory = tmp_path / "hf"
    directory.mkdir()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        tokenizer_for(Prefill(checkpoint=str(directory)))
    byte_bpe(directory / "tokenizer.json")
    tok = tokenizer_for(Prefill(checkpoint=str(directory)))
    assert isinstance(tok, HFTokenizer) and tok.decode(tok.encode("tea")) == "tea"
    (directory / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read tokenizer"):
        tokenizer_for(Prefill(checkpoint=str(directory)))
