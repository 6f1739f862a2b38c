"""POST /v1/chat/completions: the OpenAI chat API, its messages rendered with the model's chat template.

The messages are rendered with the served model's own chat template (its tokenizer files:
`shared.model.chat_template`), with ``add_generation_prompt`` so the text ends where the
assistant's answer starts, tokenized without adding special tokens (the template writes them), and
then answered exactly as /v1/completions answers that prompt (`completions.answer`): queued,
prefilled in the bubbles, the first token and the KV handle (``kv_transfer_params``), the rest from
the decoder when ``max_tokens`` > 1 and decoding is on. Only the shape differs: ``choices[].message``
(``delta`` in a stream, opened by a chunk with the assistant's role), ``object: "chat.completion"``
(``"chat.completion.chunk"``), chat logprobs.

A model without a chat template (nanoGPT, or a directory whose tokenizer files hold none) gets a
400 that says so; malformed messages get a 400 naming the field (``messages[1].role``).

Tested by: tests/unit/test_chat_request.py, tests/integration/test_chat_api.py, tests/e2e/test_openai_chat.py.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from aiohttp import web

from services.prefill_queue.api import limits, read_json
from services.prefill_queue.completions import answer
from services.prefill_queue.state import SETTINGS
from services.prefill_queue.validation import (
    MAX_LOGPROBS,
    BadRequest,
    ChatShape,
    Completion,
    Limits,
    parse_completion,
    request_object,
)
from shared.config.spec import Prefill
from shared.model.chat_template import ChatTemplate, ChatTemplateError, chat_template_for

#: Every field /v1/chat/completions accepts; the ones /v1/completions shares are honoured as it
#: honours them (or refused with a 400 naming them). Anything else is refused as unknown.
CHAT_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
        "stream_options", "logprobs", "top_logprobs", "stop", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "seed", "user", "ignore_eos", "kv_transfer_params", "ttft_objective_ms",
    }
)  # fmt: skip
#: Passed to the /v1/completions validation as they are.
_SHARED = CHAT_FIELDS - {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"}
#: The roles a message may have (tool calls are not served).
ROLES = ("system", "developer", "user", "assistant")
MESSAGE_FIELDS = frozenset({"role", "content", "name"})


@functools.lru_cache(maxsize=4)
def served_template(spec: Prefill) -> ChatTemplate | None:
    """The served model's chat template, read once per spec (`CheckpointError` if it is unusable)."""
    return chat_template_for(spec)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    received = time.perf_counter()
    body = await read_json(request)
    c = parse_chat(body, limits(request.app), served_template(request.app[SETTINGS].spec.prefill))
    return await answer(request, received, c, "chatcmpl")


def parse_messages(value: Any) -> list[dict[str, str]]:
    """The messages as the template reads them: role, content (text parts joined by newlines, as
    vLLM joins them for a template that reads strings) and an optional name."""
    if not isinstance(value, list):
        raise BadRequest(f"'messages' must be a list of messages, got {type(value).__name__}", param="messages")
    if not value:
        raise BadRequest("'messages' is empty: at least one message is needed", param="messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{at}' must be an object with 'role' and 'content'", param=at)
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise BadRequest(f"unknown field '{at}.{unknown[0]}' (a message has role, content, name)", param=at)
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"'{at}.role' must be one of {', '.join(ROLES)}; got {role!r}", param=f"{at}.role")
        message = {"role": str(role), "content": _content(m.get("content"), f"{at}.content")}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise BadRequest(f"'{at}.name' must be a string, got {type(name).__name__}", param=f"{at}.name")
            message["name"] = name
        out.append(message)
    return out


def _content(value: Any, at: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise BadRequest(f"'{at}' is required", param=at)
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{at}' must be a string or a non-empty list of text parts", param=at)
    texts = []
    for j, part in enumerate(value):
        where = f"{at}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise BadRequest(
                f"'{where}' must be a text part ({{'type': 'text', 'text': ...}}): the model reads text", param=where
            )
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise BadRequest(f"'{where}' must hold exactly 'type' and a string 'text'", param=f"{where}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _max_tokens(body: dict[str, Any]) -> tuple[Any, str]:
    """The requested completion length and the field it came in (the newer name wins, as OpenAI's)."""
    if body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"], "max_completion_tokens"
    return body.get("max_tokens"), "max_tokens"


def _logprobs(body: dict[str, Any]) -> ChatShape:
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest(f"'logprobs' must be a boolean, got {type(wanted).__name__}", param="logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return ChatShape(logprobs=bool(wanted))
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}", param="top_logprobs")
    if not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return ChatShape(logprobs=True, top_logprobs=top)


def parse_chat(body: Any, limits: Limits, template: ChatTemplate | None) -> Completion:
    """A chat request as a one-prompt `Completion` (`chat` set): the fields it shares with
    /v1/completions are checked by that endpoint's validation, the messages are rendered with
    `template` and tokenized with the served model's tokenizer."""
    body = request_object(body, CHAT_FIELDS, "/v1/chat/completions", required="messages")
    messages = parse_messages(body["messages"])
    shape = _logprobs(body)
    max_tokens, max_field = _max_tokens(body)
    plain = {k: v for k, v in body.items() if k in _SHARED}
    plain["max_tokens"] = max_tokens
    plain["logprobs"] = max(1, shape.top_logprobs) if shape.logprobs else 0  # the token's own needs one
    _completion(plain, [0], limits, max_field)  # every other field checked before the messages are rendered
    if template is None:
        raise BadRequest(
            f"the model '{limits.model}' has no chat template, so /v1/chat/completions cannot render messages for "
            "it (a Hugging Face model directory holds one in tokenizer_config.json's 'chat_template' or in "
            "chat_template.jinja); send the prompt as text to /v1/completions",
            param="messages",
        )
    try:
        text = template.render(messages)
    except ChatTemplateError as exc:
        raise BadRequest(f"the model's chat template refused the messages: {exc}", param="messages") from None
    tokens = limits.tokenizer.encode(text, add_special_tokens=False)
    if not tokens:
        raise BadRequest("the messages render to an empty prompt with the model's chat template", param="messages")
    c = _completion(plain, tokens, limits, max_field)
    return dataclasses.replace(c, chat=shape)


def _completion(plain: dict[str, Any], tokens: list[int], limits: Limits, max_field: str) -> Completion:
    """/v1/completions' validation of the rendered prompt; its errors name the chat's fields."""
    try:
        return parse_completion({**plain, "prompt": tokens}, limits)
    except BadRequest as exc:
        if exc.param == "prompt":
            exc.param, exc.message = "messages", f"the messages rendered with the chat template: {exc.message}"
        elif exc.param == "max_tokens" and max_field != "max_tokens":
            exc.param, exc.message = max_field, exc.message.replace("'max_tokens'", f"'{max_field}'")
        raise
