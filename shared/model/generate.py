"""Decoding after a prefill: the tokens that follow a prompt's first token, one at a time.

The decoder service continues a prompt from the KV cache a worker computed in a bubble; a local
full generation (`generate`) runs the prefill here and then the very same continuation, so the
two give the same tokens, token for token (the tests compare them).

Sampling: the first token is the prefill's (`PrefillModel.finish`: greedy at temperature 0,
else drawn with a generator seeded by the request's `seed`). Token ``n >= 1`` of the completion
is drawn with a generator seeded by ``derive_seed("decode", seed, n)``: a request with a seed is
reproducible whichever process decodes it, and no two positions share a stream. Without a seed,
fresh entropy. Greedy never draws.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from shared.model.prefill import KV, PrefillModel, sample
from shared.model.seeds import derive_seed


def step_seed(seed: int | None, n: int) -> int | None:
    """The seed of completion token `n` (n >= 1; token 0 is the prefill's)."""
    return None if seed is None else derive_seed("decode", seed, n)


@dataclass
class Continuation:
    """Generates the tokens after `first_token` from a prompt's KV cache (`kv`, one (k, v) per
    layer covering positions ``0 .. prompt_len - 1``). `tokens` is the completion so far, the
    first token included; each `step` appends one."""

    model: PrefillModel
    kv: list[KV]
    prompt_len: int
    first_token: int
    temperature: float = 0.0
    seed: int | None = None
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = [self.first_token]

    def step(self) -> int:
        """Run the last token through the model (it is at position prompt_len + len - 1) and
        pick the next one."""
        n = len(self.tokens)
        logits, self.kv = self.model.decode_step(self.kv, self.tokens[-1], self.prompt_len + n - 1)
        token = sample(logits, self.temperature, seed=step_seed(self.seed, n))
        self.tokens.append(token)
        return token

    def run(self, max_tokens: int) -> Iterator[int]:
        """Steps until the completion has `max_tokens` tokens (the first included)."""
        while len(self.tokens) < max_tokens:
            yield self.step()


def generate(
    model: PrefillModel,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    eos: Sequence[int] = (),
) -> list[int]:
    """A local full generation: prefill the prompt in one pass, then continue to `max_tokens`
    tokens in all, or to the first of the `eos` tokens (included). The reference the decoder
    service is held to."""
    first = model.prefill(prompt, temperature=temperature, seed=seed)
    c = Continuation(model, first.kv, len(prompt), first.token, temperature, seed)
    if first.token in eos:
        return c.tokens
    for token in c.run(max_tokens):
        if token in eos:
            break
    return c.tokens
