"""The official `openai` client, unchanged, against the live API while a pipeline trains.

Real processes (front door, dispatcher, WAN broker, four stage workers) over a real redis-server.
What the client gets back is what a local `PrefillModel` computes for the same prompt (tokenized
at byte level, as the front door does a string prompt), sampled the same way.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import torch
from openai import AsyncOpenAI

from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import run_training
from shared.config.settings import load_settings
from shared.model.prefill import PrefillModel
from shared.model.tokenizer import decode as decode_text
from shared.model.tokenizer import encode as encode_text
from shared.wire import keys
from tests.e2e.serving import ONE_REPLICA, SPEC, service_env, wait_for_iteration, wait_until, write_spec

PROMPT = "Hello, BubbleTea"
OTHER = "Bubbles in the pipeline"
#: A generous bound for a loaded 2-core machine (a completion waits for a bubble).
REQUEST_TIMEOUT_S = 60.0
#: Training goes on until the test has its answers and stops it: however slow a busy machine makes
#: the calls, each is made while the pipeline trains (a run that ended would refuse them).
UNTIL_DONE = 100_000


async def test_official_openai_client_gets_computed_completions(tmp_path: Path, redis_url: str) -> None:
    path = write_spec(tmp_path, **ONE_REPLICA, training={**SPEC["training"], "iterations": UNTIL_DONE})
    run = f"openai-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    model_name = settings.spec.prefill.model_name
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    async with front_door(env, out=out) as door:
        assert door.url is not None
        training = asyncio.create_task(run_training(settings, redis_url, out=out, progress=False, dispatcher=True))
        client = AsyncOpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        try:
            await wait_for_iteration(redis_url, run, 1)
            models = await client.models.list()
            # As documented: the OpenAI call unchanged (so sampled at temperature 1, with the seed)...
            sampled = await client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, logprobs=2, seed=1)
            # ... and greedy.
            greedy = await client.completions.create(
                model=model_name, prompt=PROMPT, max_tokens=1, logprobs=2, seed=1, temperature=0
            )
            # Streamed, as vLLM's benchmark and genai-perf always ask: the token, then usage, then [DONE].
            stream = await client.completions.create(
                model=model_name,
                prompt=PROMPT,
                max_tokens=1,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            # A list of prompts: one choice each.
            several = await client.completions.create(
                model=model_name, prompt=[PROMPT, OTHER], max_tokens=1, temperature=0
            )
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5)
            assert not training.done(), out.getvalue()[-3000:]  # it trained throughout, without failing
        finally:
            await client.close()
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)

    assert model_name in [m.id for m in models.data]

    tokens = encode_text(PROMPT)  # the front door tokenizes a string prompt at byte level
    assert tokens == list(PROMPT.encode())
    model = PrefillModel.from_spec(settings.spec.prefill)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        want_sampled = model.prefill(tokens, temperature=1.0, seed=1, top_logprobs=2)
        want_greedy = model.prefill(tokens, temperature=0.0, top_logprobs=2)
        want_other = model.prefill(encode_text(OTHER), temperature=0.0)
    finally:
        torch.set_num_threads(threads)

    for got, want in ((sampled, want_sampled), (greedy, want_greedy)):
        assert got.object == "text_completion" and got.model == model_name
        assert len(got.choices) == 1
        choice = got.choices[0]
        assert choice.text == want.text == decode_text([want.token])
        assert choice.finish_reason == "length"
        assert got.usage is not None
        assert got.usage.prompt_tokens == len(tokens) == 16
        assert got.usage.completion_tokens == 1 and got.usage.total_tokens == len(tokens) + 1
        lp = choice.logprobs
        assert lp is not None and lp.tokens == [want.text]
        assert lp.token_logprobs is not None and lp.token_logprobs[0] == pytest.approx(want.logprob, abs=1e-5)
        assert lp.top_logprobs is not None
        top = lp.top_logprobs[0]
        assert set(top) == {decode_text([t]) for t, _ in want.top}
        for t, logprob in want.top:
            if [decode_text([u]) for u, _ in want.top].count(decode_text([t])) == 1:  # no U+FFFD clash
                assert top[decode_text([t])] == pytest.approx(logprob, abs=1e-5)
        # Beyond the OpenAI shape: where the prompt's KV cache waits for a decode service.
        kv = (got.model_extra or {})["kv_transfer_params"]
        assert kv["store"] == "plane" and kv["key"] == got.id and kv["holder"] and kv["bytes"] > 0
    token_chunk, usage_chunk = chunks
    assert [c.text for c in token_chunk.choices] == [want_greedy.text] and token_chunk.choices[
        0
    ].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (16, 1)
    assert [(c.index, c.text) for c in several.choices] == [(0, want_greedy.text), (1, want_other.text)]
    assert several.usage is not None and several.usage.prompt_tokens == 16 + len(OTHER)
    # The greedy answer is the most likely token.
    assert want_greedy.token == want_greedy.top[0][0]

    err = refused.value
    assert err.status_code == 400
    assert "prefill" in err.message
    assert isinstance(err.body, dict) and err.body["param"] == "max_tokens" and "prefill" in err.body["message"]


async def test_official_client_gets_whole_completions_decoded_from_the_bubbles_kv(
    tmp_path: Path, redis_url: str
) -> None:
    """With the decoder on: the prompt is prefilled in the bubbles, the decoder continues it from its
    KV cache, and the text equals a local full generation with the same model, token for token."""
    from bubbletea.launcher.procs import spawn, stop_all
    from bubbletea.launcher.services import DECODER
    from shared.model.generate import generate

    path = write_spec(
        tmp_path,
        **ONE_REPLICA,
        training={**SPEC["training"], "iterations": UNTIL_DONE},
        decode={"enabled": True, "max_tokens": 64},
    )
    run = f"decode-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    model_name = settings.spec.prefill.model_name
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    async with front_door(env, out=out) as door:
        assert door.url is not None
        decoder = await spawn(DECODER, env, out=out, quiet=True)
        training = asyncio.create_task(run_training(settings, redis_url, out=out, progress=False, dispatcher=True))
        client = AsyncOpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        try:
            await wait_for_iteration(redis_url, run, 1)
            whole = await client.completions.create(model=model_name, prompt=PROMPT, max_tokens=20, temperature=0)
            seeded = await client.completions.create(
                model=model_name, prompt=OTHER, max_tokens=16, temperature=0.8, seed=5
            )
            stream = await client.completions.create(
                model=model_name,
                prompt=PROMPT,
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            # The KV caches stay in the workers that prefilled them (prefill.kv_store: plane): the
            # decoder fetched each over the data plane and frees it right after the last chunk it
            # sends (so one that dies before the chunk is out can be resumed from it): after the
            # answer, not before it. The workers' heartbeats say how many they served and hold:
            # every one fetched, none left (they would stay held for kv_ttl_s, 120 s, otherwise).
            kv: dict[str, tuple[int, int]] = {}

            async def all_freed() -> bool:
                kv.clear()
                kv.update(await _kv_held(redis_url, run))
                return (
                    len(kv) == settings.spec.parallelism.pp * settings.spec.parallelism.dp  # every worker's
                    and sum(served for served, _ in kv.values()) >= 3
                    and not any(held for _, held in kv.values())
                )

            await wait_until(all_freed, "the decoder freeing every KV cache it fetched", timeout=30)
            assert not [k async for k in _kv_keys(redis_url, run)], "a KV cache went through Redis"
        finally:
            await client.close()
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            await stop_all([decoder])

    model = PrefillModel.from_spec(settings.spec.prefill)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        want = decode_text(generate(model, encode_text(PROMPT), 20))
        want_seeded = decode_text(generate(model, encode_text(OTHER), 16, temperature=0.8, seed=5))
    finally:
        torch.set_num_threads(threads)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length", out.getvalue()[-3000:]
    assert whole.usage is not None and whole.usage.completion_tokens == 20
    assert seeded.choices[0].text == want_seeded
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == want and len([c for c in chunks if c.choices]) >= 2  # it arrived in pieces
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert not any(held for _, held in kv.values()), kv  # every KV cache was freed once decoded


async def _kv_held(redis_url: str, run: str) -> dict[str, tuple[int, int]]:
    """Each of the run's KV holders (a worker's "host:port"): the caches it served and holds now,
    as its last heartbeat says."""
    from redis.asyncio import Redis

    from shared.control.health import live_instances

    r = Redis.from_url(redis_url)
    try:
        workers = [w for w in await live_instances(r, "stage_worker") if w["run"] == run and "kv_held" in w]
    finally:
        await r.aclose()
    return {w["kv_holder"]: (w["kv_served"], w["kv_held"]) for w in workers}


async def _kv_keys(redis_url: str, run: str) -> AsyncIterator[bytes]:
    from redis.asyncio import Redis

    r = Redis.from_url(redis_url)
    try:
        async for k in r.scan_iter(match=keys.kv_cache_key(run, "*")):
            yield k
    finally:
        await r.aclose()


async def test_a_hugging_face_checkpoint_serves_whole_completions_as_transformers_generates(
    tmp_path: Path, redis_url: str
) -> None:
    """A user's local checkpoint directory (here a tiny random Qwen2 made by transformers): the
    prompt tokenized by its tokenizer, prefilled in the bubbles, decoded by the decoder; the text
    is what transformers' own greedy `generate` gives, stopping at the model's EOS token too."""
    from bubbletea.launcher.procs import spawn, stop_all
    from bubbletea.launcher.services import DECODER
    from shared.model.tokenizer import tokenizer_for
    from tests.unit.test_hf_models import save

    ckpt = save("qwen2", tmp_path / "qwen2")
    path = write_spec(
        tmp_path,
        **ONE_REPLICA,
        training={**SPEC["training"], "iterations": UNTIL_DONE},
        prefill={**SPEC["prefill"], "checkpoint": str(ckpt.path)},
        decode={"enabled": True, "max_tokens": 32},
    )
    run = f"hf-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_url, path, run)
    out = io.StringIO()
    prompts = ["the quick brown fox", "bubble tea, hello", "lazy dog"]
    async with front_door(env, out=out) as door:
        assert door.url is not None
        decoder = await spawn(DECODER, env, out=out, quiet=True)
        training = asyncio.create_task(run_training(settings, redis_url, out=out, progress=False, dispatcher=True))
        client = AsyncOpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        try:
            await wait_for_iteration(redis_url, run, 1)
            try:
                got = await client.completions.create(
                    model=settings.spec.prefill.model_name, prompt=prompts, max_tokens=24, temperature=0
                )
            except (openai.APITimeoutError, openai.APIStatusError) as exc:  # failed: the services' logs say why
                raise AssertionError(f"{exc}\n{out.getvalue()[-6000:]}") from None
            models = await client.models.list()
        finally:
            await client.close()
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            await stop_all([decoder])

    tok = tokenizer_for(settings.spec.prefill)
    assert models.data[0].model_extra is not None and models.data[0].model_extra["max_model_len"] == 128
    for choice, prompt in zip(sorted(got.choices, key=lambda ch: ch.index), prompts, strict=True):
        ids = tok.encode(prompt)
        with torch.no_grad():
            full = ckpt.hf.generate(
                torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=1, pad_token_id=1
            )[0, len(ids) :].tolist()
        assert choice.text == tok.decode(full), (prompt, full, out.getvalue()[-2000:])
        assert choice.finish_reason == ("stop" if full[-1] == 1 else "length")  # EOS (id 1) ends it
    assert got.usage is not None and got.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
