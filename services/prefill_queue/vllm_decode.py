"""Decoding on vLLM: a prompt prefilled in the bubbles continues on a vLLM server (`decode.engine: vllm`).

The front door sends vLLM the prompt's token ids followed by the first token the bubbles computed,
with the KV cache's handle in ``kv_transfer_params``; vLLM's BubbleTea connector (the
`bubbletea-vllm` package) loads every prompt position from the worker holding the cache, so vLLM
computes no prompt token: its first forward pass is the position of our first token, whose logits
give the second. The completion streams back as vLLM streams it (``stream: true`` with
``return_token_ids``), one `DecodeChunk` per vLLM event, into the same text and stop handling as
the built-in decoder's (`decoding.whole`). The connector frees the cache when vLLM finishes the
request, however it ends.

Failures are explicit and keep the client's request answered: vLLM unreachable or answering an
error (a cache that expired, was freed or whose worker is gone fails the request inside vLLM, whose
log says which: "the BubbleTea KV cache was not loaded: ...") ends the completion with
`FailureReason.KV_MISSING` (503, retry) or `MODEL_REFUSED` for a request vLLM refuses (4xx); the
request's deadline cuts a slow decode with `FailureReason.DEADLINE`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp

from shared.config.spec import Decode
from shared.dataplane.kv_client import KvClient
from shared.runtime.logs import get_logger
from shared.wire import DecodeChunk, PrefillRequest
from shared.wire.status import FailureReason, RequestStatus

log = get_logger(__name__)


class VllmDecoder:
    """The front door's client of one vLLM server (an aiohttp session kept for the app's life)."""

    def __init__(self, cfg: Decode) -> None:
        self.url = cfg.vllm_url.rstrip("/")
        self.model = cfg.vllm_model
        self._session: aiohttp.ClientSession | None = None
        #: Frees a cache vLLM never took (it was unreachable or refused the request): once vLLM has
        #: the request, its connector frees the cache when the request finishes.
        self.kv = KvClient()
        self.forwarded = 0

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self.kv.close()

    async def _free(self, handle: dict[str, Any]) -> None:
        if handle.get("store") == "plane":
            await self.kv.free(str(handle["holder"]), str(handle["key"]), timeout_s=2.0)

    async def served_model(self) -> str:
        """`decode.vllm_model`, or else the first model vLLM lists (asked once)."""
        if not self.model:
            async with self.session().get(f"{self.url}/v1/models") as resp:
                resp.raise_for_status()
                models = (await resp.json())["data"]
            if not models:
                raise RuntimeError(f"the vLLM server at {self.url} serves no model")
            self.model = str(models[0]["id"])
        return self.model

    def body(
        self, model: str, req: PrefillRequest, first: int | None, handle: dict[str, Any], max_tokens: int,
        stop: tuple[str, ...], ignore_eos: bool,
    ) -> dict[str, Any]:  # fmt: skip
        """vLLM's /v1/completions request that continues `req` after its first token; with no
        `first` (the prompt placed on the decoder), the whole completion, vLLM computing the prompt."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(req.tokens) if first is None else [*req.tokens, first],
            "max_tokens": max_tokens if first is None else max_tokens - 1,  # the first token: the bubbles'
            "temperature": req.temperature,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": ignore_eos,
        }
        if first is not None:
            body["kv_transfer_params"] = handle
        if req.seed is not None:
            body["seed"] = req.seed
        if stop:
            body["stop"] = list(stop)
        return body

    async def continue_completion(
        self, req: PrefillRequest, first: int | None, handle: dict[str, Any], max_tokens: int,
        stop: tuple[str, ...], ignore_eos: bool, timeout_s: float,
    ) -> AsyncGenerator[DecodeChunk, None]:  # fmt: skip
        """The chunks of `req`'s completion after its first token, as vLLM streams them; the last
        is marked done (a failure too). With no `first`: from the first token (index 0), the prompt
        computed by vLLM itself (`prompt_placement`: the decoder's own prefill)."""
        index = 0 if first is None else 1

        def failed(reason: FailureReason, why: str) -> DecodeChunk:
            log.warning("decoding on vLLM failed", id=req.id, reason=reason.value, detail=why)
            return DecodeChunk(id=req.id, index=index, done=True, status=RequestStatus.FAILED, reason=reason, error=why)

        taken = False  # vLLM has the request: its connector frees the cache, whatever happens next
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                model = await self.served_model()
                body = self.body(model, req, first, handle, max_tokens, stop, ignore_eos)
                async with self.session().post(f"{self.url}/v1/completions", json=body) as resp:
                    taken = resp.status == 200
                    if resp.status != 200:
                        text = (await resp.text())[:500]
                        reason = FailureReason.MODEL_REFUSED if 400 <= resp.status < 500 else FailureReason.KV_MISSING
                        yield failed(reason, _why(self.url, resp.status, text))
                        return
                    self.forwarded += 1
                    async for event in _events(resp):
                        if "error" in event:
                            yield failed(FailureReason.KV_MISSING, _why(self.url, 500, json.dumps(event["error"])))
                            return
                        for ch in event.get("choices", ()):
                            tokens = tuple(ch.get("token_ids") or ())
                            finish = ch.get("finish_reason")
                            if finish == "error":
                                yield failed(FailureReason.KV_MISSING, _why(self.url, 500, "finish_reason error"))
                                return
                            if tokens or finish:
                                yield DecodeChunk(
                                    id=req.id,
                                    index=index,
                                    tokens=tokens,
                                    done=finish is not None,
                                    finish_reason=finish,
                                    stop_reason=ch.get("stop_reason")
                                    if isinstance(ch.get("stop_reason"), str)
                                    else None,
                                )
                                index += len(tokens)
                                if finish is not None:
                                    return
                    yield failed(FailureReason.KV_MISSING, f"the vLLM server at {self.url} ended the stream early")
        except TimeoutError:
            yield failed(FailureReason.DEADLINE, f"the completion was not finished by its deadline ({index} tokens)")
        except aiohttp.ClientError as exc:
            yield failed(FailureReason.KV_MISSING, f"the vLLM server at {self.url} is unreachable: {exc}")
        finally:
            if not taken:
                await self._free(handle)


def _why(url: str, status: int, text: str) -> str:
    hint = (
        " (a KV cache that expired, was freed or whose worker is gone fails the request inside vLLM: "
        "its log says which, on a line saying 'the BubbleTea KV cache was not loaded')"
        if status >= 500
        else ""
    )
    return f"the vLLM server at {url} answered {status}: {text.strip()}{hint}"


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent-events body, until ``data: [DONE]``."""
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def deadline_s(req: PrefillRequest, default_s: float) -> float:
    """Seconds left to `req`'s deadline (wall clock), or `default_s` without one."""
    return req.deadline - time.time() if req.deadline is not None else default_s
