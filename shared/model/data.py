"""A deterministic byte-level training corpus, and the byte tokenizer made tensor-aware.

Tokens are UTF-8 bytes (ids 0..255), so any model with ``vocab >= 256`` can read any text. The
tokenizer itself is `shared.model.tokenizer` (no torch); `decode` here also takes a tensor.

The default corpus is the Python standard library's own source (`ByteCorpus.from_stdlib`): it
exists on every machine that has Python, so no download is needed. It is identical on two
machines only if they run the same Python build; compare `ByteCorpus.fingerprint()` across
processes that must train on the same data.

Every microbatch is a pure function of ``(seed, iteration, index)`` (`ByteCorpus.batch`), drawn
with a local generator, so any process can rebuild any microbatch without communication.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from shared.model import tokenizer
from shared.model.seeds import generator
from shared.model.tokenizer import encode as encode  # re-exported beside the tensor-aware decode

#: Directory names never descended into when collecting the stdlib corpus.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def decode(ids: Iterable[int] | Tensor) -> str:
    """`shared.model.tokenizer.decode` of byte ids given as ints or as a tensor of them."""
    return tokenizer.decode(ids.tolist() if isinstance(ids, Tensor) else ids)


def _stdlib_sources(root: Path) -> list[Path]:
    """`.py` files under `root`, sorted by relative POSIX path, outside the `SKIP_DIRS`."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]  # prune in place: never walk into them
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return [root / r for r in sorted(found)]


class ByteCorpus:
    """A 1-D uint8 tensor of bytes to sample training windows from (at least 2 bytes)."""

    def __init__(self, data: Tensor) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(f"corpus data must be a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
        if data.numel() < 2:
            raise ValueError(f"corpus needs at least 2 bytes (one input and one target), got {data.numel()}")
        self.data = data

    def __len__(self) -> int:
        return self.data.numel()

    @classmethod
    def from_bytes(cls, data: bytes) -> ByteCorpus:
        """A corpus holding a copy of `data`."""
        # frombuffer wants a non-empty writable buffer; clone so the tensor owns its memory.
        if not data:
            return cls(torch.empty(0, dtype=torch.uint8))  # rejected by __init__ with a clear message
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8).clone())

    @classmethod
    def from_stdlib(cls, max_bytes: int = 2_000_000) -> ByteCorpus:
        """The `.py` files of this Python's standard library, concatenated, truncated to `max_bytes`.

        Files are taken in order of their path relative to ``sysconfig.get_paths()["stdlib"]``;
        `site-packages`/`dist-packages` (third-party code) and `test`/`tests` directories are
        skipped, as are files that cannot be read. Deterministic for a given Python installation.
        """
        if max_bytes < 2:
            raise ValueError(f"max_bytes must be >= 2, got {max_bytes}")
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks: list[bytes] = []
        total = 0
        for path in _stdlib_sources(root):
            if total >= max_bytes:
                break
            try:
                content = path.read_bytes()
            except OSError:
                continue
            chunks.append(content[: max_bytes - total])
            total += len(chunks[-1])
        if total < 2:
            raise ValueError(f"no Python sources found under the standard library at {root}")
        return cls.from_bytes(b"".join(chunks))

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the bytes: equal fingerprints mean equal corpora."""
        return hashlib.sha256(self.data.numpy().tobytes()).hexdigest()

    def batch(self, iteration: int, index: int, batch_size: int, seq_len: int, seed: int) -> tuple[Tensor, Tensor]:
        """Microbatch `index` of `iteration`: inputs x and targets y, both int64 (batch_size, seq_len).

        Each row is a random window of the corpus and ``y[:, t] == x[:, t + 1]`` (y is x shifted
        one byte ahead). The windows depend only on ``(seed, iteration, index)`` and the corpus;
        the global RNG is neither used nor advanced. In pipeline training, microbatch j of
        data-parallel replica d uses ``index = d * microbatches + j``.
        """
        return sample_windows(self.data, "batch", iteration, index, batch_size, seq_len, seed, unit="bytes")


def sample_windows(
    stream: Tensor, key: str, iteration: int, index: int, batch_size: int, seq_len: int, seed: int, *, unit: str
) -> tuple[Tensor, Tensor]:
    """`batch_size` random windows of `seq_len` + 1 ids of the 1-D `stream`, as inputs x and targets
    y (int64 (batch_size, seq_len), y one id ahead), their starts drawn from the generator keyed by
    (`key`, seed, iteration, index): a pure function of those, the global RNG untouched."""
    if iteration < 0 or index < 0:
        raise ValueError(f"iteration and index must be >= 0, got {iteration} and {index}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    n = stream.numel()
    if n < seq_len + 1:
        raise ValueError(f"corpus of {n} {unit} is too short for windows of {seq_len} + 1 {unit}")
    g = generator(key, seed, iteration, index)
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=g)  # (B,) in [0, n - seq_len - 1]
    offsets = starts[:, None] + torch.arange(seq_len + 1)  # (B, T + 1)
    window = stream[offsets].long()  # (B, T + 1)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # (B, T), (B, T)
