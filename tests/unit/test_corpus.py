"""The token corpus: files packed in order with end-of-text between documents, JSONL fields, every
refusal with its one-line message, and microbatches that are pure functions of their arguments."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from shared.model.corpus import (
    BPE_EOS,
    DataError,
    TokenCorpus,
    eos_id,
    load_tokenizer,
    train_bpe_tokenizer,
)
from shared.model.tokenizer import HFTokenizer

VOCAB = 512  # the model's vocab_size
BPE_VOCAB = 400  # the trained tokenizer's (fits VOCAB)

SUBJECTS = ["The teapot", "A small cat", "Every pipeline", "Our replica", "The gradient", "A quiet bubble"]
VERBS = ["waits for", "sends", "fills", "computes", "receives", "drains"]
OBJECTS = ["the next stage.", "a warm cup of tea.", "one more microbatch.", "the prefill request.", "its own KV cache."]


def sentences() -> list[str]:
    """A few hundred deterministic lines of English-like text (180 distinct, each twice)."""
    lines = [f"{s} {v} {o}" for s, v, o in itertools.product(SUBJECTS, VERBS, OBJECTS)]
    return lines + [line.lower() for line in lines]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe_tokenizer(sentences(), BPE_VOCAB, tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def tok(tok_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tok_path))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(path: Path, rows: list[object]) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def big_corpus(tmp_path: Path, tok_path: Path) -> TokenCorpus:
    return TokenCorpus.from_files([write(tmp_path / "big.txt", "\n".join(sentences()))], tok_path, vocab=VOCAB)


# --- train_bpe_tokenizer ----------------------------------------------------------------------


def test_bpe_tokenizer_is_deterministic_and_has_eos(tmp_path: Path, tok_path: Path, tok: Tokenizer) -> None:
    again = train_bpe_tokenizer(sentences(), BPE_VOCAB, tmp_path / "sub" / "tokenizer.json")
    assert again == tmp_path / "sub" / "tokenizer.json"
    assert again.read_bytes() == tok_path.read_bytes()
    assert tok.token_to_id(BPE_EOS) == 0
    assert eos_id(tok) == 0
    assert 257 <= tok.get_vocab_size(with_added_tokens=True) <= BPE_VOCAB


def test_bpe_tokenizer_reads_with_the_serving_loader(tok_path: Path) -> None:
    served = HFTokenizer(tok_path)
    assert served.vocab_size <= BPE_VOCAB
    text = "The teapot sends naïve tea 🫖 to the next stage."
    assert served.decode(served.encode(text)) == text  # byte-level: any text round-trips
    assert served.decode([0]) == ""  # the end-of-text token is special: skipped when decoding


def test_bpe_tokenizer_needs_room_for_bytes_and_eos(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 257"):
        train_bpe_tokenizer(["abc"], 256, tmp_path / "tokenizer.json")


# --- packing ----------------------------------------------------------------------------------


def test_files_are_packed_in_order_with_eos_after_each(tmp_path: Path, tok_path: Path, tok: Tokenizer) -> None:
    a = write(tmp_path / "a.txt", "The teapot waits for the next stage.\nA small cat sends tea.")
    b = write(tmp_path / "b.md", "# Notes\n\nOur replica drains its own KV cache.")
    corpus = TokenCorpus.from_files([a, str(b)], tok_path, vocab=VOCAB)
    expected = [*ids(tok, a.read_text()), 0, *ids(tok, b.read_text()), 0]
    assert corpus.tokens.tolist() == expected
    assert corpus.tokens.dim() == 1 and corpus.tokens.dtype == torch.int32
    assert len(corpus) == len(expected)
    assert corpus.eos == 0
    reverse = TokenCorpus.from_files([b, a], tok_path, vocab=VOCAB)
    assert reverse.tokens.tolist() == [*ids(tok, b.read_text()), 0, *ids(tok, a.read_text()), 0]


def test_jsonl_documents_are_the_field_of_each_line(tmp_path: Path, tok_path: Path, tok: Tokenizer) -> None:
    path = write(
        tmp_path / "docs.jsonl",
        json.dumps({"text": "The teapot fills a warm cup.", "id": 1})
        + "\n\n   \n"  # blank lines are skipped
        + json.dumps({"text": ""})  # an empty document adds nothing, not even an end-of-text token
        + "\n"
        + json.dumps({"text": "Every pipeline computes.", "body": "ignored"})
        + "\n",
    )
    corpus = TokenCorpus.from_files([path], tok_path, vocab=VOCAB)
    assert corpus.tokens.tolist() == [
        *ids(tok, "The teapot fills a warm cup."),
        0,
        *ids(tok, "Every pipeline computes."),
        0,
    ]

    other = jsonl(tmp_path / "other.jsonl", [{"body": "One more microbatch."}, {"body": "The prefill request."}])
    by_body = TokenCorpus.from_files([other], tok_path, vocab=VOCAB, field="body")
    assert by_body.tokens.tolist() == [*ids(tok, "One more microbatch."), 0, *ids(tok, "The prefill request."), 0]


def test_no_eos_token_means_nothing_appended(tmp_path: Path) -> None:
    word = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    word.save(str(tmp_path / "word.json"))
    files = [write(tmp_path / "1.txt", "a b"), write(tmp_path / "2.txt", "b a c")]
    corpus = TokenCorpus.from_files(files, tmp_path / "word.json", vocab=3)
    assert corpus.eos is None
    assert corpus.tokens.tolist() == [0, 1, 1, 0, 2]


def test_eos_is_the_first_candidate_the_vocab_has(tmp_path: Path) -> None:
    word = Tokenizer(models.WordLevel({"a": 0, "<eos>": 1, "</s>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    word.save(str(tmp_path / "word.json"))
    corpus = TokenCorpus.from_files([write(tmp_path / "1.txt", "a a")], tmp_path / "word.json", vocab=4)
    assert corpus.eos == 2  # "</s>" comes before "<eos>" in the candidates
    assert corpus.tokens.tolist() == [0, 0, 2]


def test_ids_fit_the_model_vocab(tmp_path: Path, tok_path: Path) -> None:
    corpus = big_corpus(tmp_path, tok_path)
    assert int(corpus.tokens.min()) >= 0
    assert int(corpus.tokens.max()) < BPE_VOCAB <= VOCAB
    x, y = corpus.batch(0, 0, 8, 32, seed=1)
    assert int(x.max()) < VOCAB and int(y.max()) < VOCAB


def test_fingerprint_is_equal_for_equal_inputs(tmp_path: Path, tok_path: Path) -> None:
    a = write(tmp_path / "a.txt", "The teapot waits.")
    b = write(tmp_path / "b.txt", "A small cat sends tea.")
    one = TokenCorpus.from_files([a, b], tok_path, vocab=VOCAB)
    two = TokenCorpus.from_files([a, b], tok_path, vocab=VOCAB)
    assert one.fingerprint() == two.fingerprint()
    assert len(one.fingerprint()) == 64
    assert TokenCorpus.from_files([b, a], tok_path, vocab=VOCAB).fingerprint() != one.fingerprint()
    assert TokenCorpus(one.tokens.long()).fingerprint() == one.fingerprint()  # int64 input is stored as int32


# --- refusals ---------------------------------------------------------------------------------


def refused(match: str, *args: object, **kwargs: object) -> DataError:
    with pytest.raises(DataError, match=match) as info:
        TokenCorpus.from_files(*args, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)
    return info.value


def test_empty_list_of_files(tok_path: Path) -> None:
    refused(r"training\.data is empty: expected a list of local text or JSONL files", [], tok_path, vocab=VOCAB)


def test_missing_path_and_directory(tmp_path: Path, tok_path: Path) -> None:
    err = refused(
        r"training\.data: .*nope\.txt does not exist \(nothing is downloaded\)",
        [tmp_path / "nope.txt"],
        tok_path,
        vocab=VOCAB,
    )
    assert "local text or JSONL file" in str(err)
    refused(r"training\.data: .* is not a file", [tmp_path], tok_path, vocab=VOCAB)


def test_paths_are_checked_before_tokenizing(tmp_path: Path) -> None:
    # The missing data file is named even though the tokenizer is missing too.
    refused(r"nope\.txt does not exist", [tmp_path / "nope.txt"], tmp_path / "tokenizer.json", vocab=VOCAB)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r"line 2 is not JSON .*'\{not json'"),
        ("[1, 2]", r"line 2 is an array, not a JSON object"),
        ('"text"', r"line 2 is a string, not a JSON object"),
        ('{"body": "x"}', r"line 2 has no 'text' field \(found keys \['body'\]\)"),
        ('{"text": 3}', r"line 2 field 'text' is a number, not a string"),
        ('{"text": null}', r"line 2 field 'text' is null, not a string"),
    ],
)
def test_bad_jsonl_lines(tmp_path: Path, tok_path: Path, line: str, match: str) -> None:
    path = write(tmp_path / "bad.jsonl", json.dumps({"text": "fine"}) + "\n" + line + "\n")
    err = refused(match, [path], tok_path, vocab=VOCAB)
    assert f"training.data: {path} line 2" in str(err)
    assert "expected one JSON object per line with a string 'text' field" in str(err)


def test_files_without_tokens(tmp_path: Path, tok_path: Path) -> None:
    good = write(tmp_path / "good.txt", "The teapot waits.")
    empty = write(tmp_path / "empty.txt", "")
    refused(r"training\.data: .*empty\.txt yields no tokens", [good, empty], tok_path, vocab=VOCAB)
    blank = write(tmp_path / "blank.jsonl", "\n\n" + json.dumps({"text": ""}) + "\n")
    refused(r"blank\.jsonl yields no tokens", [blank], tok_path, vocab=VOCAB)


def test_non_utf8_file(tmp_path: Path, tok_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9")
    refused(r"latin1\.txt is not UTF-8 text", [path], tok_path, vocab=VOCAB)


def test_missing_or_unreadable_tokenizer(tmp_path: Path) -> None:
    data = [write(tmp_path / "a.txt", "The teapot waits.")]
    refused(
        r"tokenizer\.json .*missing\.json does not exist \(nothing is downloaded\)",
        data,
        tmp_path / "missing.json",
        vocab=VOCAB,
    )
    refused(r"tokenizer\.json .* is not a file", data, tmp_path, vocab=VOCAB)
    garbage = write(tmp_path / "garbage.json", "{ this is not a tokenizer")
    refused(r"cannot read tokenizer\.json .*garbage\.json", data, garbage, vocab=VOCAB)


def test_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path: Path, tok_path: Path, tok: Tokenizer) -> None:
    size = tok.get_vocab_size(with_added_tokens=True)
    data = [write(tmp_path / "a.txt", "The teapot waits.")]
    refused(
        rf"tokenizer\.json has {size} tokens but the model's vocab_size is 256: the tokenizer does not match the model",
        data,
        tok_path,
        vocab=256,
    )
    with pytest.raises(DataError, match="does not match the model"):
        load_tokenizer(tok_path, size - 1)
    assert load_tokenizer(tok_path, size).get_vocab_size(with_added_tokens=True) == size  # exactly fits


# --- batch ------------------------------------------------------------------------------------


def test_batch_shapes_dtypes_and_shift(tmp_path: Path, tok_path: Path) -> None:
    corpus = big_corpus(tmp_path, tok_path)
    x, y = corpus.batch(3, 5, batch_size=4, seq_len=16, seed=7)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    stream = corpus.tokens.long()
    for row_x, row_y in zip(x, y, strict=True):
        window = torch.cat([row_x, row_y[-1:]])
        starts = [s for s in range(len(stream) - 16) if torch.equal(stream[s : s + 17], window)]
        assert starts, "each row is a window of the packed stream"


def test_batch_is_a_pure_function_of_its_arguments(tmp_path: Path, tok_path: Path) -> None:
    corpus = big_corpus(tmp_path, tok_path)
    rng = torch.get_rng_state()
    x, y = corpus.batch(2, 1, 8, 24, seed=0)
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG is neither used nor advanced"
    x2, y2 = corpus.batch(2, 1, 8, 24, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    rebuilt = big_corpus(tmp_path, tok_path)  # another process rebuilding the same microbatch
    assert torch.equal(rebuilt.batch(2, 1, 8, 24, seed=0)[0], x)
    assert not torch.equal(corpus.batch(3, 1, 8, 24, seed=0)[0], x)  # another iteration
    assert not torch.equal(corpus.batch(2, 2, 8, 24, seed=0)[0], x)  # another microbatch / replica
    assert not torch.equal(corpus.batch(2, 1, 8, 24, seed=1)[0], x)  # another seed


def test_batch_covers_the_whole_stream(tmp_path: Path, tok_path: Path) -> None:
    # A stream of exactly seq_len + 1 tokens has one window; one of seq_len + 2 has two, both drawn.
    stream = torch.arange(10, dtype=torch.int32)
    x, y = TokenCorpus(stream).batch(0, 0, 3, 9, seed=0)
    assert x.tolist() == [list(range(9))] * 3 and y.tolist() == [list(range(1, 10))] * 3
    starts = {int(TokenCorpus(stream).batch(i, 0, 1, 8, seed=0)[0][0, 0]) for i in range(64)}
    assert starts == {0, 1}


def test_batch_refuses_bad_arguments_and_short_corpora() -> None:
    corpus = TokenCorpus(torch.arange(10, dtype=torch.int64))
    with pytest.raises(ValueError, match="iteration and index must be >= 0"):
        corpus.batch(-1, 0, 1, 4, seed=0)
    with pytest.raises(ValueError, match="iteration and index must be >= 0"):
        corpus.batch(0, -1, 1, 4, seed=0)
    with pytest.raises(ValueError, match="batch_size and seq_len must be >= 1"):
        corpus.batch(0, 0, 0, 4, seed=0)
    with pytest.raises(ValueError, match="batch_size and seq_len must be >= 1"):
        corpus.batch(0, 0, 1, 0, seed=0)
    with pytest.raises(ValueError, match=r"corpus of 10 tokens is too short for windows of 10 \+ 1 tokens"):
        corpus.batch(0, 0, 1, 10, seed=0)


def test_token_tensor_is_checked() -> None:
    with pytest.raises(ValueError, match="1-D int32 or int64"):
        TokenCorpus(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D int32 or int64"):
        TokenCorpus(torch.zeros(4))
    with pytest.raises(ValueError, match="token ids must be in"):
        TokenCorpus(torch.tensor([0, -1]))
