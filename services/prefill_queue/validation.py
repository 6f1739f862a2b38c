"""Parsing and validating prefill requests (pure): every bad input gets a 4xx that names the field.

Two shapes: the OpenAI completions body (``POST /v1/completions``) and the native body
(``POST /v1/prefill``). Both become one `ParsedRequest`. Prompts are text (tokenized at byte level)
or a list of token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.model.tokenizer import encode

#: OpenAI allows up to 5 top logprobs on completions; we follow it.
MAX_LOGPROBS = 5


class BadRequest(Exception):
    """An invalid request: HTTP `status`, a message for the client, and the offending field."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, type_: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_


@dataclass(frozen=True)
class Limits:
    model: str  # the served model id
    vocab: int
    max_prompt_tokens: int
    default_timeout_s: float


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    tokens: tuple[int, ...]
    temperature: float
    seed: int | None
    logprobs: int
    user: str
    timeout_s: float  # relative deadline


def _type_error(field: str, expected: str, value: Any) -> BadRequest:
    return BadRequest(f"'{field}' must be {expected}, got {type(value).__name__}", param=field)


def _int(body: dict[str, Any], field: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(field, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(field, "an integer", v)
    if not lo <= v <= hi:
        raise BadRequest(f"'{field}' must be between {lo} and {hi}, got {v}", param=field)
    return v


def _number(body: dict[str, Any], field: str, default: float, lo: float, hi: float) -> float:
    v = body.get(field, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(field, "a finite number", v)
    if not lo <= v <= hi:
        raise BadRequest(f"'{field}' must be between {lo} and {hi}, got {v}", param=field)
    return float(v)


def _tokens(prompt: Any, limits: Limits) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the OpenAI client sends a one-element list for a single string
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", param="prompt")
        ids = tuple(encode(prompt))
    elif isinstance(prompt, list):
        if not prompt:
            raise BadRequest("'prompt' is an empty list", param="prompt")
        if any(isinstance(p, str) for p in prompt):
            raise BadRequest("one prompt per request: 'prompt' must be a string or a list of token ids", param="prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise BadRequest("'prompt' as a list must hold integer token ids", param="prompt")
        bad = [t for t in prompt if not 0 <= t < limits.vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary 0..{limits.vocab - 1}", param="prompt")
        ids = tuple(prompt)
    else:
        raise _type_error("prompt", "a string or a list of token ids", prompt)
    if len(ids) > limits.max_prompt_tokens:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens; this service accepts at most {limits.max_prompt_tokens}", param="prompt"
        )
    return ids


def _common(body: Any, limits: Limits, *, default_temperature: float) -> tuple[dict[str, Any], ParsedRequest]:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model", limits.model)
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model != limits.model:
        raise BadRequest(
            f"the model '{model}' does not exist; this service serves '{limits.model}'",
            param="model",
            status=404,
            type_="not_found_error",
        )
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", param="prompt")
    user = body.get("user", "")
    if not isinstance(user, str):
        raise _type_error("user", "a string", user)
    logprobs = _int(body, "logprobs", 0, 0, MAX_LOGPROBS) or 0
    parsed = ParsedRequest(
        model=model,
        tokens=_tokens(body["prompt"], limits),
        temperature=_number(body, "temperature", default_temperature, 0.0, 2.0),
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        logprobs=logprobs,
        user=user,
        timeout_s=limits.default_timeout_s,
    )
    return body, parsed


def parse_completion(body: Any, limits: Limits) -> ParsedRequest:
    """An OpenAI completions request. Only the prefill (one token) is served: ``max_tokens`` must
    be 1 (it defaults to 1 here); the KV cache handle goes to a decode service."""
    body, parsed = _common(body, limits, default_temperature=1.0)
    max_tokens = _int(body, "max_tokens", 1, 0, 2**31)
    if max_tokens != 1:
        raise BadRequest(
            f"'max_tokens' must be 1: this service does prefill only and returns the first token with "
            f"a handle to the KV cache (kv_transfer_params) for a decode service; got {max_tokens}",
            param="max_tokens",
        )
    if body.get("stream"):
        raise BadRequest("streaming is not supported: a prefill returns one token", param="stream")
    n = _int(body, "n", 1, 1, 2**31)
    if n != 1:
        raise BadRequest(f"'n' must be 1, got {n}", param="n")
    return parsed


def parse_native(body: Any, limits: Limits) -> ParsedRequest:
    """A native ``POST /v1/prefill`` body: prompt, optional model, temperature (default greedy), seed,
    logprobs, user, and ``deadline_ms`` (after which the request fails explicitly)."""
    body, parsed = _common(body, limits, default_temperature=0.0)
    deadline_ms = _number(body, "deadline_ms", limits.default_timeout_s * 1000, 1.0, 86_400_000.0)
    return ParsedRequest(**{**parsed.__dict__, "timeout_s": deadline_ms / 1000})
