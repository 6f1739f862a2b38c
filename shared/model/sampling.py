"""The one sampling rule for the next token: `PrefillModel.finish`'s first token and every
decoder's later ones (`shared.model.generate`, the decoder service)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def sample(
    logits: Tensor, temperature: float, *, seed: int | None = None, generator: torch.Generator | None = None
) -> int:
    """The next token from `logits` (vocab,), as `PrefillModel.finish` and a decoder pick it.

    ``temperature == 0``: the argmax (greedy; nothing is drawn). Otherwise a draw from
    softmax(logits / temperature) with `generator` if given, else a fresh CPU generator seeded by
    `seed` (None = fresh entropy). The draw happens on the generator's device (the CPU unless a
    generator says otherwise; the probabilities are copied there), so a seed picks the same token
    whichever device computed the logits. The global RNG is never used.
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if temperature == 0:
        return int(torch.argmax(logits).item())
    if generator is None:
        generator = torch.Generator(device="cpu")  # deliberately the CPU: see the docstring
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    # Shift by the max before dividing: a tiny temperature then gives -inf (probability 0) for the
    # others instead of inf - inf = nan.
    probs = F.softmax((logits - logits.max()) / temperature, dim=-1)  # (vocab,)
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator).item())
