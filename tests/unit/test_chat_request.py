"""Validating /v1/chat/completions bodies (pure): the messages rendered with the model's chat
template become one prompt, answered as /v1/completions answers it; every bad input is a 4xx
naming its field, and a model without a template is a 400 that says so."""

from __future__ import annotations

from typing import Any

import pytest

from services.prefill_queue.chat import CHAT_FIELDS, parse_chat
from services.prefill_queue.validation import BadRequest, ChatShape, Limits
from shared.model.chat_template import ChatTemplate

TEMPLATE = ChatTemplate.compile(
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
STRICT = ChatTemplate.compile(
    "{% if messages[-1].role != 'user' %}{{ raise_exception('the last message must be the user') }}{% endif %}x"
)
LIM = Limits(model="m", vocab=256, max_prompt_tokens=64, default_timeout_s=5.0)
DECODING = Limits(model="m", vocab=256, max_prompt_tokens=64, default_timeout_s=5.0, max_tokens=32)
HI = [{"role": "user", "content": "hi"}]


def test_the_messages_are_rendered_and_tokenized_into_one_prompt() -> None:
    c = parse_chat({"model": "m", "messages": [{"role": "system", "content": "s"}, *HI]}, LIM, TEMPLATE)
    assert [p.tokens for p in c.prompts] == [tuple(b"<system>s<user>hi<assistant>")]
    assert c.chat == ChatShape() and c.max_tokens == 1 and not c.stream
    assert c.object_name(chunk=False) == "chat.completion" and c.object_name(chunk=True) == "chat.completion.chunk"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]  # joined by a newline, as vLLM does
    assert parse_chat({"messages": [{"role": "user", "content": parts}]}, LIM, TEMPLATE).prompts[0].tokens == tuple(
        b"<user>a\nb<assistant>"
    )


def test_the_shared_fields_mean_what_they_mean_on_completions() -> None:
    c = parse_chat(
        {
            "messages": HI,
            "max_completion_tokens": 8,
            "temperature": 0,
            "seed": 3,
            "stop": ["\n"],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        DECODING,
        TEMPLATE,
    )
    assert (c.max_tokens, c.prompts[0].temperature, c.prompts[0].seed, c.stop) == (8, 0.0, 3, ("\n",))
    assert c.stream and c.include_usage
    assert parse_chat({"messages": HI, "max_tokens": 5}, DECODING, TEMPLATE).max_tokens == 5
    shaped = parse_chat({"messages": HI, "logprobs": True, "top_logprobs": 2}, LIM, TEMPLATE)
    assert shaped.chat == ChatShape(logprobs=True, top_logprobs=2) and shaped.prompts[0].logprobs == 2
    assert parse_chat({"messages": HI, "logprobs": True}, LIM, TEMPLATE).prompts[0].logprobs == 1


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({}, "messages", "'messages' is required"),
        ({"messages": "hi"}, "messages", "must be a list"),
        ({"messages": []}, "messages", "is empty"),
        ({"messages": ["hi"]}, "messages[0]", "must be an object"),
        ({"messages": [*HI, {"role": "robot", "content": "x"}]}, "messages[1].role", "must be one of"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "must be one of"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "a string or"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "text"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]", "tool_calls"),
        ({"messages": [{"role": "user", "content": "x", "name": 1}]}, "messages[0].name", "a string"),
        ({"messages": HI, "tools": []}, "tools", "unknown field 'tools'"),
        ({"messages": HI, "prompt": "x"}, "prompt", "unknown field 'prompt'"),
        ({"messages": HI, "max_tokens": 8}, "max_tokens", "prefill only"),
        ({"messages": HI, "max_completion_tokens": 8}, "max_completion_tokens", "'max_completion_tokens' must be 1"),
        ({"messages": HI, "logprobs": 2}, "logprobs", "a boolean"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
        ({"messages": HI, "logprobs": True, "top_logprobs": 9}, "top_logprobs", "from 0 to 5"),
        ({"messages": HI, "n": 2}, "n", "must be 1"),
        ({"messages": [{"role": "user", "content": "x" * 80}]}, "messages", "accepts at most 64"),
    ],
)
def test_a_bad_body_names_the_field(body: dict[str, Any], param: str, fragment: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_chat(body, LIM, TEMPLATE)
    assert refused.value.status == 400 and refused.value.param == param
    assert fragment in refused.value.message


def test_the_model_must_be_the_served_one() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_chat({"model": "other", "messages": HI}, LIM, TEMPLATE)
    assert refused.value.status == 404 and refused.value.param == "model"


def test_a_model_without_a_chat_template_is_a_400_that_says_so() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_chat({"messages": HI}, LIM, None)
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "has no chat template" in refused.value.message and "/v1/completions" in refused.value.message


def test_the_templates_own_refusal_is_a_400_with_its_message() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_chat({"messages": [{"role": "assistant", "content": "x"}]}, LIM, STRICT)
    assert refused.value.param == "messages" and "the last message must be the user" in refused.value.message


def test_the_openapi_schema_names_exactly_the_accepted_chat_fields() -> None:
    from services.prefill_queue.openapi import spec

    content = spec("m", 8)["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    body = content["application/json"]["schema"]
    assert set(body["properties"]) == CHAT_FIELDS and body["additionalProperties"] is False
    assert body["required"] == ["messages"]
