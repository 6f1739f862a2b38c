"""Parsing and validating prefill requests (pure): every bad input gets a 4xx that names the field.

Two shapes: the OpenAI completions body (``POST /v1/completions``) and the native body
(``POST /v1/prefill``). Both become one `ParsedRequest`. Prompts are text (tokenized by the served
model's tokenizer, `Limits.tokenizer`) or a list of token ids.

Tested by: tests/unit/test_prefill_validation.py, tests/unit/test_chat_request.py,
tests/integration/test_hostile_clients.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from shared.model.tokenizer import BYTES, Tokenizer

#: OpenAI allows up to 5 top logprobs on completions; we follow it.
MAX_LOGPROBS = 5
#: OpenAI allows up to 4 stop sequences.
MAX_STOP = 4
#: Prompts in one completions request (each is queued and answered on its own).
MAX_PROMPTS = 256

#: Every field /v1/completions accepts; each is honoured or refused with a 400 naming it
#: (docs/api.md says how). Anything else is refused as unknown.
COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
        "echo", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "best_of", "logit_bias",
        "user", "seed", "suffix", "ignore_eos", "kv_transfer_params", "return_token_ids", "ttft_objective_ms",
    }
)  # fmt: skip
#: The keys of vLLM's `kv_transfer_params` (disaggregated prefill) a request may carry.
KV_TRANSFER_FIELDS = frozenset(
    {"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host", "remote_port"}
)


class BadRequest(Exception):
    """An invalid request: HTTP `status`, a message for the client, and the offending field."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_
        #: Sent as `Retry-After` (seconds) with a 429 or 503.
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Limits:
    model: str  # the served model id
    vocab: int  # the model's vocabulary: token ids 0..vocab-1
    max_prompt_tokens: int  # min(prefill.max_prompt_tokens, the model's max_model_len)
    default_timeout_s: float
    default_objective_s: float | None = None  # the TTFT objective of a request that names none
    tokenizer: Tokenizer = BYTES  # what text prompts are tokenized with (the served model's)
    #: The largest `max_tokens`: 1 serves prefill only; more with the decoder (`decode.enabled`).
    max_tokens: int = 1
    #: Positions the model has: a prompt and its completion together fit in it (vLLM's rule).
    max_model_len: int = 1 << 30
    #: Why `max_tokens` is 1 when it is (what to change to get whole completions).
    prefill_only_because: str = "this service does prefill only"


@dataclass(frozen=True)
class ChatShape:
    """A /v1/chat/completions request: answered in the chat shape (`choices[].message`)."""

    logprobs: bool = False  # each choice carries `logprobs.content`
    top_logprobs: int = 0  # with this many alternatives per token


@dataclass(frozen=True)
class Completion:
    """A validated /v1/completions body (or a chat body, rendered: `chat`): one `ParsedRequest`
    per prompt, and how to answer."""

    prompts: tuple[ParsedRequest, ...]
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    max_tokens: int = 1  # tokens per choice in all: 1 = the prefill's first token only
    ignore_eos: bool = False  # decode past the model's end-of-sequence tokens (vLLM's field)
    return_token_ids: bool = False  # each whole choice also carries its tokens' ids (vLLM's field)
    chat: ChatShape | None = None  # answered as a chat completion (services/prefill_queue/chat.py)

    def object_name(self, *, chunk: bool) -> str:
        """The answer's `object`: a whole answer's, or (`chunk`) a streamed event's."""
        if self.chat is None:
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    tokens: tuple[int, ...]
    temperature: float
    seed: int | None
    logprobs: int
    user: str
    timeout_s: float  # relative deadline
    objective_s: float | None = None  # its TTFT objective (relative), if any


def _type_error(field: str, expected: str, value: Any) -> BadRequest:
    return BadRequest(f"'{field}' must be {expected}, got {type(value).__name__}", param=field)


def _int(body: dict[str, Any], field: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(field, default)
    if v is None:
        return default  # an explicit null means the default, as in the OpenAI API
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
        ids = tuple(limits.tokenizer.encode(prompt))
    elif isinstance(prompt, list):
        if not prompt:
            raise BadRequest("'prompt' is an empty list", param="prompt")
        if any(isinstance(p, str) for p in prompt):
            raise BadRequest(
                "'prompt' must be a string, a list of token ids, or a list of those (one choice each)", param="prompt"
            )
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


def request_object(body: Any, fields: frozenset[str], endpoint: str, *, required: str) -> dict[str, Any]:
    """An OpenAI-style request body: a JSON object with only `fields` of `endpoint`, `required` among them."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unknown field '{unknown[0]}' for {endpoint}", param=unknown[0])
    if required not in body:
        raise BadRequest(f"'{required}' is required", param=required)
    return body


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
    user = body.get("user") or ""
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
        objective_s=_objective_s(body, limits),
    )
    return body, parsed


def _objective_s(body: dict[str, Any], limits: Limits) -> float | None:
    """``ttft_objective_ms``, an extension field (as vLLM's own, e.g. ``kv_transfer_params``, are
    top-level fields): the request's own TTFT objective; absent or null, the service's default."""
    if body.get("ttft_objective_ms") is None:
        return limits.default_objective_s
    return _number(body, "ttft_objective_ms", 0.0, 1.0, 86_400_000.0) / 1000


def parse_completion(body: Any, limits: Limits) -> Completion:
    """An OpenAI completions request (what the official client and `vllm bench serve` send).

    Only the prefill is served: ``max_tokens`` must be 1 (the default here); the KV cache handle
    goes to a decode service. ``prompt`` may be a list of prompts (one choice each). Fields that
    cannot change the first token are accepted as they are honoured exactly (``presence_penalty``,
    ``frequency_penalty`` count output tokens, of which there are none before the first;
    ``ignore_eos``: with max_tokens 1 nothing follows the first token; with more, the decoder goes
    past the model's end-of-sequence tokens); ``stop`` is applied to the token's
    text; fields the service cannot honour are refused unless they have their neutral value."""
    body = request_object(body, COMPLETION_FIELDS, "/v1/completions", required="prompt")
    prompt = body["prompt"]
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    if many and len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    prompts = prompt if many else [prompt]
    parsed = tuple(_common({**body, "prompt": p}, limits, default_temperature=1.0)[1] for p in prompts)
    parse_kv_transfer(body)
    max_tokens = _int(body, "max_tokens", 1, 0, 2**31)
    assert max_tokens is not None
    if limits.max_tokens == 1 and max_tokens != 1:
        raise BadRequest(
            f"'max_tokens' must be 1: {limits.prefill_only_because}, and returns the first token with "
            f"a handle to the KV cache (kv_transfer_params) for a decode service; got {max_tokens}",
            param="max_tokens",
        )
    if not 1 <= max_tokens <= limits.max_tokens:
        raise BadRequest(
            f"'max_tokens' must be between 1 and {limits.max_tokens}, got {max_tokens}", param="max_tokens"
        )
    if max_tokens > 1:
        longest = max(len(p.tokens) for p in parsed)
        if longest + max_tokens > limits.max_model_len:
            raise BadRequest(
                f"the model's context is {limits.max_model_len} tokens: a prompt of {longest} tokens leaves room "
                f"for {max(0, limits.max_model_len - longest)} more, but max_tokens is {max_tokens}",
                param="max_tokens",
            )
        if any(p.logprobs for p in parsed):
            raise BadRequest("'logprobs' needs max_tokens 1: the decoder does not return them", param="logprobs")
        for field in ("presence_penalty", "frequency_penalty"):
            if _number(body, field, 0.0, -2.0, 2.0) != 0.0:
                raise BadRequest(f"'{field}' must be 0 with max_tokens > 1: it is not applied", param=field)
    for field, neutral in (("n", 1), ("best_of", 1)):
        if _int(body, field, neutral, 1, 2**31) != neutral:
            raise BadRequest(f"'{field}' must be 1: one completion per prompt", param=field)
    if _number(body, "top_p", 1.0, 0.0, 1.0) != 1.0:
        raise BadRequest("'top_p' must be 1: the first token is sampled from the whole distribution", param="top_p")
    if _number(body, "repetition_penalty", 1.0, 0.0, 100.0) != 1.0:
        raise BadRequest("'repetition_penalty' must be 1: it is not applied", param="repetition_penalty")
    for field in ("presence_penalty", "frequency_penalty"):
        _number(body, field, 0.0, -2.0, 2.0)  # honoured: no output token precedes the first
    for field in ("echo", "ignore_eos", "stream"):
        if not isinstance(body.get(field, False) or False, bool):
            raise _type_error(field, "a boolean", body[field])
    if body.get("echo"):
        raise BadRequest("'echo' is not supported: the answer holds the first token only", param="echo")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("'suffix' is not supported", param="suffix")
    if body.get("logit_bias") not in (None, {}):
        raise BadRequest("'logit_bias' is not supported", param="logit_bias")
    stream = bool(body.get("stream"))
    return Completion(
        prompts=parsed,
        stream=stream,
        include_usage=_stream_options(body, stream),
        stop=_stop(body.get("stop")),
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos") or False),
        return_token_ids=bool(body.get("return_token_ids") or False),
    )


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise BadRequest(f"unknown field 'stream_options.{unknown[0]}'", param=f"stream_options.{unknown[0]}")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _type_error("stream_options.include_usage", "a boolean", include)
    return include


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP:
        raise BadRequest(f"at most {MAX_STOP} stop sequences, got {len(stops)}", param="stop")
    return tuple(stops)


def parse_kv_transfer(body: dict[str, Any]) -> None:
    """vLLM's disaggregated-prefill request field: this service is the prefill side, so a request
    may ask for remote decode (the default here) but not for a remote prefill."""
    params = body.get("kv_transfer_params")
    if params is None:
        return
    if not isinstance(params, dict):
        raise _type_error("kv_transfer_params", "an object", params)
    unknown = sorted(set(params) - KV_TRANSFER_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field 'kv_transfer_params.{unknown[0]}'", param=f"kv_transfer_params.{unknown[0]}")
    if params.get("do_remote_prefill"):
        raise BadRequest(
            "'kv_transfer_params.do_remote_prefill' asks this service to decode from a remote KV cache; "
            "it is the prefill side (send do_remote_decode)",
            param="kv_transfer_params.do_remote_prefill",
        )


def parse_native(body: Any, limits: Limits) -> ParsedRequest:
    """A native ``POST /v1/prefill`` body: prompt, optional model, temperature (default greedy), seed,
    logprobs, user, and ``deadline_ms`` (after which the request fails explicitly)."""
    body, parsed = _common(body, limits, default_temperature=0.0)
    deadline_ms = _number(body, "deadline_ms", limits.default_timeout_s * 1000, 1.0, 86_400_000.0)
    return ParsedRequest(**{**parsed.__dict__, "timeout_s": deadline_ms / 1000})


#: The deepest JSON nesting a request body may have (objects and arrays; a valid request needs 3).
#: Deeper bodies get a 400 before they are parsed: the JSON parser recurses, and 10,000 levels would
#: exhaust Python's stack.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body` (JSON text, valid or not) nests arrays and objects deeper than `limit`.

    Iterative, never recursive: strings are cut out (brackets inside them do not count) and the
    brackets left are counted, stopping at the first one past the limit. UTF-8 multi-byte sequences
    hold no ASCII bytes, so scanning bytes is exact."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the common case: a valid request has a handful of brackets
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = 0
    for b in brackets:
        depth += _STEP[b]
        if depth > limit:
            return True
    return False
