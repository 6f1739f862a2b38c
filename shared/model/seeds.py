"""Derived seeds: one stable 63-bit seed from a tuple of parts, the same in every process.

Python's `hash` is salted per process, so it cannot be used here; a BLAKE2b digest of the parts'
text is stable across processes, machines and Python versions.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2**63) that depends only on `parts` (their order and values).

    Distinct tuples give unrelated seeds (e.g. ``(0, 1, 23)`` and ``(0, 12, 3)`` differ: parts
    are joined with a separator that cannot occur in an int's text).
    """
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(*parts: int | str) -> torch.Generator:
    """A fresh CPU `torch.Generator` seeded with `derive_seed(*parts)`; never the global RNG."""
    return torch.Generator(device="cpu").manual_seed(derive_seed(*parts))
