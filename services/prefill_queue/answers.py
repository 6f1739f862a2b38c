"""The OpenAI completion's pieces, shared by the one-token and the whole-completion answers: waiting
for the prefill answers, the HTTP status of a failed one, and the JSON shapes (head, choice,
usage) with the request metrics they feed. A chat request's answer is the same with its choices
reshaped (`shaped`: `message` or `delta` for `text`, chat logprobs) and a role chunk opening its
stream (`opening`).

Tested by: tests/integration/test_prefill_api.py, tests/unit/test_front_door_objective.py,
tests/unit/test_prefill_validation.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from services.prefill_queue.api import FAILED_RETRY_AFTER_S, FAILURE_STATUS
from services.prefill_queue.state import HOPS, METRICS, Stopping
from services.prefill_queue.validation import BadRequest, Completion
from shared.model.tokenizer import BYTES, Tokenizer, token_text
from shared.wire import PrefillRequest, PrefillResult
from shared.wire.status import PromptPlacement, RequestStatus

#: A request's deadline is the dispatcher's to enforce (it fails an expired request explicitly,
#: `FailureReason.DEADLINE`, a 504 here). The front door waits this much past the deadline for that
#: answer before giving up on its own: a safety net for a dispatcher that is down, not a second rule.
DEADLINE_GRACE_S = 2.0


async def as_answered(
    waiters: dict[str, asyncio.Future[PrefillResult]],
    deadline: float,
    stopping: Stopping | None = None,
    moved: Callable[[str, PrefillResult], Awaitable[PrefillResult]] | None = None,
) -> AsyncIterator[tuple[str, PrefillResult]]:
    """(request id, answer) in the order the answers land. `deadline`: the requests' (wall clock);
    past it and `DEADLINE_GRACE_S` with no answer (no dispatcher answered, not even to fail them), 504;
    503 if the front door stops and they do not come within its grace period (they stay queued).
    An answer MOVED to the decoder is replaced by `moved`'s (the decoder's first token, or why not)."""
    stopping = stopping or Stopping()
    # on the monotonic clock from here on: the wall clock may step while we wait
    timeout_s = max(0.0, deadline - time.time())
    deadline = time.monotonic() + timeout_s + DEADLINE_GRACE_S
    pending: dict[asyncio.Future[Any], str] = {fut: rid for rid, fut in waiters.items()}
    stop_wait = asyncio.ensure_future(stopping.event.wait())
    try:
        while pending:
            left = max(0.0, stopping.deadline(deadline) - time.monotonic())
            watch = {*pending} if stop_wait.done() else {*pending, stop_wait}
            done, _ = await asyncio.wait(watch, timeout=left, return_when="FIRST_COMPLETED")
            done.discard(stop_wait)  # stopping: the loop goes on with the grace deadline
            if not done and time.monotonic() >= stopping.deadline(deadline):
                first = next(iter(pending.values()))
                if stopping.event.is_set():
                    raise stopping_error(first)
                raise BadRequest(
                    f"no result within {timeout_s + DEADLINE_GRACE_S:.0f}s, its deadline passed and no dispatcher "
                    f"failed it (is one running?); the request is still queued: GET /v1/prefill/{first}",
                    status=504,
                    type_="timeout_error",
                )
            for fut in done:
                rid, result = pending.pop(fut), fut.result()
                if moved is not None and result.status is RequestStatus.MOVED:
                    pending[asyncio.ensure_future(moved(rid, result))] = rid  # the decoder computes it
                    continue
                yield rid, result
    finally:
        stop_wait.cancel()
        for fut in pending:
            if isinstance(fut, asyncio.Task):
                fut.cancel()  # a decoder's computation nobody waits for any more


def stopping_error(request_id: str) -> BadRequest:
    return BadRequest(
        f"this front door is stopping; the request stays queued and its answer will be stored: "
        f"GET /v1/prefill/{request_id} from another instance",
        status=503,
        type_="service_unavailable",
        retry_after_s=1,
    )


def raise_if_failed(r: PrefillResult) -> None:
    if not r.ok:
        status = FAILURE_STATUS[r.reason] if r.reason is not None else 500
        retry = FAILED_RETRY_AFTER_S if status in (429, 503) else None
        type_ = "rate_limit_error" if status == 429 else "server_error"
        raise BadRequest(f"the prefill failed: {r.error}", status=status, type_=type_, retry_after_s=retry)


def head(completion_id: str, req: PrefillRequest, model: str, obj: str = "text_completion") -> dict[str, Any]:
    return {"id": completion_id, "object": obj, "created": int(req.submitted), "model": model}


def shaped(c: Completion, ch: dict[str, Any], *, delta: bool = False) -> dict[str, Any]:
    """A completion choice as `c` is answered: unchanged for /v1/completions; for a chat, its text
    is the assistant's `message` (a streamed chunk's `delta`) and its logprobs the chat's."""
    if c.chat is None:
        return ch
    logprobs = None
    if c.chat.logprobs and ch["logprobs"] is not None:
        lp = ch["logprobs"]
        top = [_chat_token(t, v) for t, v in lp["top_logprobs"][0].items()][: c.chat.top_logprobs]
        logprobs = {"content": [{**_chat_token(lp["tokens"][0], lp["token_logprobs"][0]), "top_logprobs": top}]}
    text = {"delta": {"content": ch["text"]}} if delta else {"message": {"role": "assistant", "content": ch["text"]}}
    return {
        "index": ch["index"],
        **text,
        "logprobs": logprobs,
        "finish_reason": ch["finish_reason"],
        "stop_reason": ch["stop_reason"],
    }


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def opening(c: Completion, top: dict[str, Any]) -> dict[str, Any] | None:
    """The first event of a streamed chat: the assistant's role, no text yet (as OpenAI and vLLM send)."""
    if c.chat is None:
        return None
    event = {
        **top,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    return {**event, "usage": None} if c.include_usage else event


def choice(
    index: int, req: PrefillRequest, r: PrefillResult, stop: tuple[str, ...], *, tokenizer: Tokenizer = BYTES
) -> dict[str, Any]:
    """One prompt's choice. A stop sequence in the token's text ends it there (finish_reason "stop",
    `stop_reason` the sequence, as vLLM reports it); otherwise the one token is the length limit.
    The top logprobs are keyed by each token's text in the served model's `tokenizer`."""
    text, finish, stop_reason = r.text, "length", None
    for s in stop:
        at = text.find(s)
        if at >= 0:
            text, finish, stop_reason = text[:at], "stop", s
            break
    logprobs = None
    if req.logprobs:
        logprobs = {
            "tokens": [r.text],
            "token_logprobs": [r.logprob],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in r.top}],
            "text_offset": [0],
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


def usage(results: list[PrefillResult]) -> dict[str, Any]:
    """OpenAI's usage, with where the prompt tokens were computed in ``prompt_tokens_details``: an
    extension (``bubble_tokens``: in training bubbles; ``decoder_tokens``: by the decoder itself)."""
    prompt = sum(r.prompt_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": len(results),
        "total_tokens": prompt + len(results),
        "prompt_tokens_details": prompt_tokens_details(results),
    }


def prompt_tokens_details(results: Iterable[PrefillResult]) -> dict[str, int]:
    """Where the prompt tokens were computed: ``bubble_tokens`` and ``decoder_tokens``."""
    done = list(results)
    return {
        f"{p.value.removesuffix('s')}_tokens": sum(r.prompt_tokens for r in done if r.placement is p)
        for p in PromptPlacement
    }


def back_s(result: PrefillResult) -> float:
    """From `result` leaving whoever computed it (its `finished`, wall clock) to now, when it has
    landed here: its way back through Redis (0 when not said, or where clocks disagree)."""
    return max(0.0, time.time() - result.finished) if result.finished > 0 else 0.0


def hops_s(received: float, queued: float, landed: float, back: float) -> float:
    """An answer's hops through the front door, its first byte written now: from receiving the
    request to queueing it (`received`, `queued`), its way back through Redis (`back`, `back_s`), and
    from its landing (`landed`) to now (perf_counter times)."""
    return queued - received + back + time.perf_counter() - landed


def hops_seen(app: web.Application, seconds: float) -> None:
    """One answer's hops through the front door (`FrontDoorHops`), kept for the next objectives and
    in the metrics."""
    app[HOPS].observed(seconds)
    app[METRICS].hops.observe(max(0.0, seconds))


def server_timing(received: float) -> dict[str, str]:
    """The `Server-Timing` header (W3C) of a one-token answer whose head is written now: `ttft`, the
    front door's time from receiving the request (`received`, perf_counter) to its first token, in
    ms. A client's own TTFT less it is the time the front door cannot see (the network, aiohttp's
    reading of the request before the handler runs, the client's own event loop)."""
    ms = (time.perf_counter() - received) * 1000
    return {"Server-Timing": f'ttft;dur={ms:.1f};desc="front door: receipt to first token"'}


def observe(app: web.Application, received: float, choices: list[dict[str, Any]]) -> None:
    m = app[METRICS]
    m.e2e_latency.labels(m.model_name).observe(time.perf_counter() - received)
    for ch in choices:
        m.success.labels(ch["finish_reason"], m.model_name).inc()
