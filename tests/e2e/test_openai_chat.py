"""The official `openai` client's `chat.completions.create`, unchanged, against the live front door.

Real processes (front door, decoder, dispatcher, WAN broker, four stage workers) over a real
redis-server, serving a tiny random Qwen2 checkpoint made by transformers whose
tokenizer_config.json holds a chat template. What the client gets back is what transformers gives
for the same conversation: `apply_chat_template` for the prompt's tokens, greedy `generate` for
the answer (prefilled in the bubbles, continued by the decoder from the KV cache). A model without
a chat template (the byte-level nanoGPT) is refused with a 400 that says so.
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from pathlib import Path

import openai
import pytest
import torch
from openai import AsyncOpenAI

from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import run_training
from shared.config.settings import load_settings
from tests.e2e.serving import ONE_REPLICA, SPEC, service_env, wait_for_iteration, write_spec

#: A generous bound for a loaded 2-core machine (a completion waits for a bubble).
REQUEST_TIMEOUT_S = 60.0
UNTIL_DONE = 100_000  # training goes on until the test stops it: every call is made while it trains
#: ChatML, as Qwen2 ships it (a default system message when none is given).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
WHOLE = 12


async def test_the_official_client_chats_with_a_model_that_has_a_chat_template(tmp_path: Path, redis_url: str) -> None:
    from transformers import PreTrainedTokenizerFast

    from bubbletea.launcher.procs import spawn, stop_all
    from bubbletea.launcher.services import DECODER
    from shared.model.tokenizer import tokenizer_for
    from tests.unit.test_hf_models import save

    ckpt = save("qwen2", tmp_path / "qwen2")
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    (ckpt.path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, **specials}))
    path = write_spec(
        tmp_path,
        **ONE_REPLICA,
        training={**SPEC["training"], "iterations": UNTIL_DONE},
        prefill={**SPEC["prefill"], "checkpoint": str(ckpt.path), "model_name": "tiny-qwen2-chat"},
        decode={"enabled": True, "max_tokens": 32},
    )
    run = f"chat-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    async with front_door(env, out=out) as door:
        assert door.url is not None
        decoder = await spawn(DECODER, env, out=out, quiet=True)
        training = asyncio.create_task(run_training(settings, redis_url, out=out, progress=False, dispatcher=True))
        client = AsyncOpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        try:
            await wait_for_iteration(redis_url, run, 1)
            try:
                whole = await client.chat.completions.create(
                    model="tiny-qwen2-chat",
                    messages=MESSAGES,
                    max_tokens=WHOLE,
                    temperature=0,
                )
            except openai.APITimeoutError:
                raise AssertionError(out.getvalue()[-6000:]) from None
            stream = await client.chat.completions.create(
                model="tiny-qwen2-chat",
                messages=MESSAGES,
                max_completion_tokens=WHOLE,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            first = await client.chat.completions.create(
                model="tiny-qwen2-chat",
                messages=MESSAGES,
                max_tokens=1,
                temperature=0,
                logprobs=True,
            )
        finally:
            await client.close()
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            await stop_all([decoder])

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(ckpt.path / "tokenizer.json"), chat_template=CHATML, **specials)
    ids = list(hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    with torch.no_grad():
        full = ckpt.hf.generate(
            torch.tensor([ids]), max_new_tokens=WHOLE, do_sample=False, eos_token_id=1, pad_token_id=1
        )[0, len(ids) :].tolist()
    tok = tokenizer_for(settings.spec.prefill)  # the text of ids past the tokenizer's is U+FFFD, as vLLM shows it
    want = tok.decode(full)
    want_finish = "stop" if full[-1] == 1 else "length"

    assert whole.object == "chat.completion" and whole.model == "tiny-qwen2-chat"
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == want, (full, out.getvalue()[-2000:])
    assert choice.finish_reason == want_finish
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)  # the template's rendering, tokenized
    assert whole.usage.completion_tokens == len(full)
    assert (whole.model_extra or {})["kv_transfer_params"]["key"]  # the prompt's KV handle, as /v1/completions

    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # it arrived in pieces: the role first, then the text (in one piece or more: how many depends on
    # when the decoder's chunks land, as for /v1/completions in test_openai_client.py)
    assert len([c for c in chunks if c.choices]) >= 2
    assert chunks[0].choices[0].delta.content in (None, "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want_finish
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(ids)

    (one,) = first.choices
    assert one.message.content == tok.decode(full[:1]) and one.finish_reason in (
        "length",
        "stop",
    )
    assert one.logprobs is not None and one.logprobs.content is not None and len(one.logprobs.content) == 1
    assert one.logprobs.content[0].logprob <= 0


async def test_a_model_without_a_chat_template_is_refused_with_a_400_that_says_so(
    tmp_path: Path, redis_url: str
) -> None:
    path = write_spec(tmp_path)  # the byte-level nanoGPT: no tokenizer files, no template
    env = service_env(redis_url, path, f"nochat-{uuid.uuid4().hex[:6]}")
    out = io.StringIO()
    async with front_door(env, out=out) as door:
        assert door.url is not None
        client = AsyncOpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="bubbletea-gpt", messages=MESSAGES)
            with pytest.raises(openai.BadRequestError) as malformed:
                await client.chat.completions.create(
                    model="bubbletea-gpt",
                    messages=[{"role": "robot", "content": "x"}],
                )
        finally:
            await client.close()
    assert refused.value.status_code == 400 and "has no chat template" in refused.value.message
    assert isinstance(refused.value.body, dict) and refused.value.body["type"] == "invalid_request_error"
    assert isinstance(malformed.value.body, dict) and malformed.value.body["param"] == "messages[0].role"
