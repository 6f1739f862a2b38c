"""POST /v1/chat/completions over real HTTP against a real redis-server.

The served model is a Hugging Face directory as the front door reads it (config.json, a trained
tokenizer.json and a tokenizer_config.json holding a chat template and its special tokens): the
request on the stream carries the template's rendering, tokenized without added special tokens.
Answers are written with `shared.control.serving.answer`, the call the serving plane makes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.prefill_queue.app import create_app
from shared.config.settings import Settings
from shared.control import serving
from shared.model.corpus import BPE_EOS, train_bpe_tokenizer
from shared.model.tokenizer import HFTokenizer
from tests.integration.test_prefill_api import REQUESTS, RUN, ok_result, read_sse, settings_for, take_requests

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def model_dir(path: Path, *, template: bool) -> Path:
    """A llama-shaped model directory as the front door reads it (no weights: it only tokenizes)."""
    path.mkdir()
    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, 300, path / "tokenizer.json")
    config = {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 320,
        "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_config: dict[str, Any] = {"bos_token": BPE_EOS, "eos_token": BPE_EOS}  # GPT-2's way: one for both
    if template:
        tokenizer_config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert tok.is_file()
    return path


def serving_dir(redis_url: str, directory: Path, **env: str) -> Settings:
    s = settings_for(redis_url, **env)
    prefill = msgspec.structs.replace(s.spec.prefill, checkpoint=str(directory), model_name="tiny-chat")
    return Settings(**{**s.__dict__, "spec": msgspec.structs.replace(s.spec, prefill=prefill)})


@pytest.fixture
async def chat(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[TestClient, Path]]:
    d = model_dir(tmp_path / "model", template=True)
    async with TestClient(TestServer(create_app(serving_dir(redis_url, d)))) as c:
        yield c, d


def rendered_tokens(d: Path) -> tuple[int, ...]:
    text = f"{BPE_EOS}<|system|>Be brief.{BPE_EOS}<|user|>Hello{BPE_EOS}<|assistant|>"
    return tuple(HFTokenizer(d / "tokenizer.json").encode(text, add_special_tokens=False))


async def test_a_chat_is_rendered_prefilled_and_answered_in_the_chat_shape(
    chat: tuple[TestClient, Path], redis: Redis
) -> None:
    client, d = chat
    body = {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 1}
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    (req,) = await take_requests(redis, 1)
    assert req.tokens == rendered_tokens(d) and req.tokens.count(0) == 3  # the special tokens the template wrote
    assert await serving.answer(redis, RUN, ok_result(req), req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200, await resp.text()
    got = await resp.json()
    assert got["object"] == "chat.completion" and got["model"] == "tiny-chat" and got["id"].startswith("chatcmpl-")
    (ch,) = got["choices"]
    assert ch["message"] == {"role": "assistant", "content": "A"} and ch["finish_reason"] == "length"
    (lp,) = ch["logprobs"]["content"]
    assert lp["token"] == "A" and lp["logprob"] == -0.5 and lp["bytes"] == [65]
    top = HFTokenizer(d / "tokenizer.json").decode([65])  # the top alternatives' text is the tokenizer's
    assert [(t["token"], t["logprob"]) for t in lp["top_logprobs"]] == [(top, -0.5)]
    n = len(req.tokens)
    assert got["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 1,
        "total_tokens": n + 1,
        "prompt_tokens_details": {"bubble_tokens": n, "decoder_tokens": 0},  # computed in the bubbles
    }
    assert got["kv_transfer_params"]["key"] == f"bt:kv:{req.id}"  # the same KV handle as /v1/completions


async def test_a_streamed_chat_sends_the_role_then_the_text_then_usage(
    chat: tuple[TestClient, Path], redis: Redis
) -> None:
    client, _ = chat
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    (req,) = await take_requests(redis, 1)
    assert await serving.answer(redis, RUN, ok_result(req, 66), req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events, _, done = await read_sse(resp)
    assert done
    role, text, tail = events
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text["choices"][0]["delta"] == {"content": "B"} and text["choices"][0]["finish_reason"] == "length"
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == 1


async def test_bad_messages_are_a_400_naming_the_field_and_nothing_is_queued(
    chat: tuple[TestClient, Path], redis: Redis
) -> None:
    client, _ = chat
    for messages, param in (([{"role": "robot", "content": "x"}], "messages[0].role"), ("hi", "messages")):
        resp = await client.post("/v1/chat/completions", json={"messages": messages})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    assert await redis.xlen(REQUESTS) == 0


async def test_a_model_without_a_chat_template_gets_a_400_that_says_so(
    redis_url: str, redis: Redis, tmp_path: Path
) -> None:
    d = model_dir(tmp_path / "plain", template=False)
    for settings in (settings_for(redis_url), serving_dir(redis_url, d)):  # nanoGPT; a directory without one
        async with TestClient(TestServer(create_app(settings))) as c:
            resp = await c.post("/v1/chat/completions", json={"messages": MESSAGES})
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert "has no chat template" in error["message"] and error["code"] == 400
    assert await redis.xlen(REQUESTS) == 0


async def test_the_api_key_and_the_openapi_document_cover_chat(redis_url: str, tmp_path: Path) -> None:
    d = model_dir(tmp_path / "model", template=True)
    async with TestClient(TestServer(create_app(serving_dir(redis_url, d, BUBBLETEA_API_KEY="s3cret")))) as c:
        resp = await c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
        wrong = await c.post("/v1/chat/completions", json={"messages": "x"}, headers={"Authorization": "Bearer no"})
        assert wrong.status == 401
        spec = await (await c.get("/openapi.json")).json()
    post = spec["paths"]["/v1/chat/completions"]["post"]
    assert "messages" in post["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"400", "401", "429", "503"} <= set(post["responses"])


async def test_a_broken_chat_template_stops_the_start_naming_it(redis_url: str, tmp_path: Path) -> None:
    from shared.config.model_info import CheckpointError

    d = model_dir(tmp_path / "model", template=False)
    (d / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja"):
        create_app(serving_dir(redis_url, d))
