"""A real vLLM decodes what BubbleTea prefilled in training bubbles (docs/vllm.md).

One tiny Llama (GQA) made here; one `vllm serve` of it with the BubbleTea connector; one
`bubbletea up --decode vllm` whose front door prefills in the bubbles and forwards to that vLLM.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from bubbletea_vllm.kvclient import KvClient, KvUnavailable

from bench.lib.vllm_stack import (
    MODEL_NAME,
    bubbletea_up,
    make_tiny_llama,
    metric,
    serving_spec,
    vllm_python,
    vllm_server,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPTS = 20
NEW_TOKENS = 16
#: How long the workers keep a KV cache: short, so the expiry case waits it out in the test.
KV_TTL_S = 15
#: The connector's counters in vLLM's Prometheus metrics (bubbletea_vllm.stats).
CONNECTOR_COUNTS = (
    "vllm:bubbletea_kv_loads_total",
    "vllm:bubbletea_kv_tokens_loaded_total",
    "vllm:bubbletea_kv_load_failures_total",
    "vllm:bubbletea_kv_frees_total",
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    return make_tiny_llama(workdir / "tiny-llama")


@pytest.fixture(scope="module")
def vllm(workdir: Path, model: Path) -> Iterator[str]:
    python = vllm_python()
    assert python is not None  # the conftest skips the tier without it
    with vllm_server(python, model, workdir / "vllm.log") as url:
        yield url


@pytest.fixture(scope="module")
def front_door(workdir: Path, model: Path, vllm: str) -> Iterator[str]:
    # placement auto (the default with vLLM), with an objective every prompt meets in the bubbles:
    # these tests pin the bubbles' path (the decoder's: `decoder_door`)
    spec = serving_spec(workdir, model, kv_ttl_s=KV_TTL_S, request_timeout_s=120, ttft_objective_ms=600_000)
    with bubbletea_up(spec, workdir / "up", "--decode", "vllm", "--vllm-url", vllm) as api:
        yield api


def prompts() -> list[list[int]]:
    """20 prompts of 16-200 token ids (never 0, the model's end-of-sequence id)."""
    rng = random.Random(2026)
    return [[rng.randrange(1, 1000) for _ in range(rng.randint(16, 200))] for _ in range(PROMPTS)]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_vllm_decodes_our_prefill_token_for_token_and_computes_no_prompt_token(
    vllm: str, front_door: str
) -> None:
    ps = prompts()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        external0 = await metric(http, vllm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        local0 = await metric(http, vllm, "vllm:prompt_tokens_by_source_total", source="local_compute")
        counted0 = {k: await metric(http, vllm, k) for k in CONNECTOR_COUNTS}
        p2p0 = await metric(http, vllm, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
        ours, handles = [], []
        for p in ps:
            status, body = await post(
                http, front_door,
                {"model": MODEL_NAME, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                 "ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            assert status == 200, body
            ours.append(body["choices"][0]["token_ids"])
            handles.append(body["kv_transfer_params"])
        external1 = await metric(http, vllm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        local1 = await metric(http, vllm, "vllm:prompt_tokens_by_source_total", source="local_compute")
        p2p1 = await metric(http, vllm, "vllm:prompt_tokens_cached_by_source_total", source="p2p")

        alone = []
        for p in ps:
            status, body = await post(
                http, vllm,
                {"model": MODEL_NAME, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                 "ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            assert status == 200, body
            alone.append(body["choices"][0]["token_ids"])
        local2 = await metric(http, vllm, "vllm:prompt_tokens_by_source_total", source="local_compute")
        # the frees run off vLLM's path and are counted at vLLM's next steps: these requests' steps
        counted = {k: await metric(http, vllm, k) - counted0[k] for k in CONNECTOR_COUNTS}

    assert [len(t) for t in ours] == [NEW_TOKENS] * PROMPTS
    mismatched = [i for i in range(PROMPTS) if ours[i] != alone[i]]
    assert not mismatched, {i: (ours[i], alone[i]) for i in mismatched}
    prompt_tokens = sum(len(p) for p in ps)
    # Every prompt position came from BubbleTea's caches; vLLM computed, per request, only the
    # position of the first token the bubbles sampled (its logits give the second): no prompt token.
    assert external1 - external0 == prompt_tokens
    assert local1 - local0 == PROMPTS
    assert local2 - local1 == prompt_tokens  # and vLLM alone computes them all (the counter counts)
    # the connector's own counts, exported by vLLM: a load per request, from a peer in vLLM's terms
    assert counted == {
        "vllm:bubbletea_kv_loads_total": PROMPTS,
        "vllm:bubbletea_kv_tokens_loaded_total": prompt_tokens,
        "vllm:bubbletea_kv_load_failures_total": 0,
        "vllm:bubbletea_kv_frees_total": PROMPTS,
    }, counted
    assert p2p1 - p2p0 == prompt_tokens
    # the connector freed every cache once its request finished
    client = KvClient(timeout_s=5)
    for h in handles:
        with pytest.raises(KvUnavailable, match=r"not held|freed|expired"):
            client.fetch(h["holder"], h["key"])
    client.close()


async def test_a_streamed_completion_arrives_in_pieces_and_equals_the_whole(vllm: str, front_door: str) -> None:
    p = prompts()[0]
    body = {"model": MODEL_NAME, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        status, whole = await post(http, front_door, body)
        assert status == 200, whole
        pieces = []
        async with http.post(f"{front_door}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    pieces.append(event["choices"][0]["text"])
    assert len([x for x in pieces if x]) > 1
    assert "".join(pieces) == whole["choices"][0]["text"]


async def test_a_freed_expired_or_orphaned_handle_fails_the_request_in_vllm_saying_why(
    vllm: str, front_door: str, workdir: Path
) -> None:
    ps = prompts()[:3]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        handles = []
        for p in ps:
            status, body = await post(
                http, front_door, {"model": MODEL_NAME, "prompt": p, "max_tokens": 1, "temperature": 0}
            )
            assert status == 200, body
            handles.append(body["kv_transfer_params"])
        assert all(h["store"] == "plane" and h["prompt_tokens"] == len(p) for h, p in zip(handles, ps, strict=True))
        freed, expired, orphaned = handles
        client = KvClient(timeout_s=5)
        assert client.free(freed["holder"], freed["key"])
        client.close()
        orphaned = {**orphaned, "holder": "127.0.0.1:9"}  # nothing listens there: the holder is gone
        failures_before = await metric(http, vllm, "vllm:request_success_total", finished_reason="error")
        load_failures_before = await metric(http, vllm, "vllm:bubbletea_kv_load_failures_total")
        for h, p in ((freed, ps[0]), (orphaned, ps[2])):
            status, body = await post(
                http, vllm,
                {"model": MODEL_NAME, "prompt": p, "max_tokens": 4, "temperature": 0, "kv_transfer_params": h},
            )  # fmt: skip
            assert status >= 500, body
        await asyncio.sleep(KV_TTL_S + 1)  # the worker's shelf drops it once its time is up
        status, body = await post(
            http, vllm,
            {"model": MODEL_NAME, "prompt": ps[1], "max_tokens": 4, "temperature": 0, "kv_transfer_params": expired},
        )  # fmt: skip
        assert status >= 500, body
        failures = await metric(http, vllm, "vllm:request_success_total", finished_reason="error") - failures_before
        load_failures = await metric(http, vllm, "vllm:bubbletea_kv_load_failures_total") - load_failures_before
    assert failures == 3 and load_failures == 3, (failures, load_failures)
    log = (workdir / "vllm.log").read_text(errors="replace")
    said = [line for line in log.splitlines() if "the BubbleTea KV cache was not loaded" in line]
    # the connector logs through vLLM's logging (logger vllm.bubbletea_vllm.worker): vLLM's format
    assert all(re.search(r" ERROR \S+ \S+ \[worker\.py:\d+\] request ", line) for line in said), said
    assert any(freed["key"] in line or "freed" in line for line in said), said
    assert any("127.0.0.1:9" in line and "gone" in line for line in said), said
    assert len(said) >= 3, said


def test_up_starts_vllm_itself_serves_through_it_and_leaves_nothing_behind(workdir: Path, model: Path) -> None:
    """`bubbletea up --decode vllm` without --vllm-url: vLLM from .venv-vllm (the documented path)."""
    import os
    import urllib.request

    python = vllm_python()
    assert python is not None
    spec = serving_spec(workdir / "managed", model)
    with bubbletea_up(spec, workdir / "managed", "--decode", "vllm", "--vllm-python", str(python)) as api:
        log = (workdir / "managed" / "up.log").read_text()
        assert "vllm healthy at" in log and "decoded by vLLM at" in log, log
        req = urllib.request.Request(
            f"{api}/v1/completions",
            data=json.dumps({"prompt": prompts()[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as resp:
            body = json.loads(resp.read())
        assert len(body["choices"][0]["token_ids"]) == 8, body
        vllm_pid = int(re.search(r"started vllm \(pid (\d+)\)", log).group(1))  # type: ignore[union-attr]
    # up stopped: vLLM's server, engine core and worker (its process group) are gone
    assert "stopped cleanly" in (workdir / "managed" / "up.log").read_text()
    with pytest.raises(ProcessLookupError):
        os.killpg(vllm_pid, 0)


@pytest.fixture(scope="module")
def decoder_door(workdir: Path, model: Path, vllm: str) -> Iterator[str]:
    """A second front door, `prefill.placement: decoder`: vLLM computes every prompt itself."""
    spec = serving_spec(workdir / "decoder", model, request_timeout_s=120, placement="decoder")
    with bubbletea_up(spec, workdir / "decoder", "--decode", "vllm", "--vllm-url", vllm) as api:
        yield api


async def test_a_prompt_placed_on_the_decoder_is_computed_by_vllm_once_and_the_answer_says_so(
    vllm: str, decoder_door: str
) -> None:
    """Placed on the decoder, a prompt is one vLLM request: vLLM computes the prompt (its
    `local_compute` counter grows by the prompt's length, not twice that) and its tokens are vLLM
    alone's; the usage says `decoder_tokens`. With vLLM's rate measured, a 1 ms objective is one it
    cannot meet: that request is refused at once with a 429 saying why."""
    p = prompts()[5]
    body = {"model": MODEL_NAME, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        local0 = await metric(http, vllm, "vllm:prompt_tokens_by_source_total", source="local_compute")
        status, placed = await post(http, decoder_door, body)
        assert status == 200, placed
        local1 = await metric(http, vllm, "vllm:prompt_tokens_by_source_total", source="local_compute")
        status, alone = await post(http, vllm, body)
        assert status == 200, alone
        async with http.post(f"{decoder_door}/v1/completions", json={**body, "ttft_objective_ms": 1}) as resp:
            refused, retry_after = resp.status, resp.headers.get("Retry-After")
            error = (await resp.json())["error"]["message"]
    assert placed["usage"]["prompt_tokens_details"] == {"bubble_tokens": 0, "decoder_tokens": len(p)}
    assert placed["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert local1 - local0 == len(p)  # once: its first token and the rest are one vLLM request
    assert refused == 429 and retry_after is not None and "the decoder's recent prompts took" in error, error
