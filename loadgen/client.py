"""Sending one request to the API (a prefill, or with max_tokens > 1 a whole completion) and
recording what happened.

Every request ends in an `Outcome` (loadgen/outcome.py, with the error classes), never an
exception: a load test must count failures, not stop at the first one. With the completions
endpoint the request streams by default, as `vllm bench serve` does (`"stream": true` with
`stream_options.include_usage`), and the events are read as loadgen/stream.py describes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import aiohttp

from loadgen.outcome import MAX_MESSAGE, Answer, Outcome, RequestFailed, error_message
from loadgen.stream import StreamTally, as_int, json_or_none, server_ttft_s, sse_data

ENDPOINTS = ("completions", "native")
#: What --endpoint accepts: vLLM passes the path, loadgen's own names are kept.
ENDPOINT_NAMES = {
    "/v1/completions": "completions",
    "completions": "completions",
    "/v1/prefill": "native",
    "native": "native",
}
#: The `backend` recorded in the results (vLLM's key): the OpenAI completions API, or the native one.
BACKENDS = {"completions": "openai", "native": "bubbletea"}
#: Native status polling: start fast (a prefill can take a few ms), back off so thousands of
#: waiting requests do not turn into a flood of GETs that competes with the work measured.
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05
#: Retrying GET /v1/models and /ready while the API starts (--ready-check-timeout-sec): a tenth of
#: a second doubling to a quarter. A training run's service opens the moment its workers have all
#: joined (the front door re-reads that verdict every 0.25 s), and a load started while the run
#: starts should follow within that, not a second later; four GETs a second cost nothing.
READY_FIRST_S = 0.1
READY_MAX_S = 0.25
#: One GET /v1/models attempt gives up after this long.
MODELS_TIMEOUT_S = 10.0
#: An HTTP header name (RFC 9110 token); a value may not contain a line break.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class ApiUnavailable(Exception):
    """The API cannot be used at all (unreachable, or refuses us): the run does not start.
    `retryable` when waiting may help (no answer, or a 5xx from a server that is starting)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def endpoint_name(text: str) -> str:
    """'/v1/completions' -> 'completions', '/v1/prefill' -> 'native'; loadgen's own names pass."""
    try:
        return ENDPOINT_NAMES[text]
    except KeyError:
        raise ValueError(f"the endpoint must be one of {', '.join(ENDPOINT_NAMES)}, got {text!r}") from None


def check_header(name: str, value: str) -> None:
    """Refuse a header aiohttp would refuse on every request (the run would be all errors)."""
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a valid HTTP header name")
    if "\r" in value or "\n" in value:
        raise ValueError(f"the value of header {name!r} contains a line break")


def poll_delays(first: float = POLL_FIRST_S, cap: float = POLL_MAX_S) -> Iterator[float]:
    """Sleeps between status polls: `first`, doubling, capped at `cap`, forever."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


def normalize_base_url(url: str) -> str:
    """'http://h:8000/', 'http://h:8000/v1' -> 'http://h:8000': OpenAI clients are configured
    with the /v1 suffix, so accept it rather than build '/v1/v1/...' paths."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def new_session() -> aiohttp.ClientSession:
    """One session (one connection pool) for the whole run.

    limit=0 lifts aiohttp's default cap of 100 connections: with it, request 101 would wait for
    a free connection inside the client and that wait would be measured as server latency.
    Concurrency is limited on purpose by --max-concurrency instead. No session timeout: each
    request gets its own deadline in `PrefillClient.send`.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
    )


class PrefillClient:
    """Talks to one prefill API through a shared session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        endpoint: str = "completions",
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        stream: bool = True,
        headers: dict[str, str] | None = None,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"the endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        self.session = session
        self.base_url = normalize_base_url(base_url)
        self.endpoint = endpoint
        self.model = model
        self.timeout_s = timeout_s
        self.stream = stream and endpoint == "completions"  # the native API never streams
        # Extra headers win over the API key's, as in vLLM (--header Authorization=... replaces it).
        self.headers = {**({"Authorization": f"Bearer {api_key}"} if api_key else {}), **(headers or {})}

    # --- start-up check ------------------------------------------------------------------------

    async def list_models(self, timeout_s: float = MODELS_TIMEOUT_S) -> list[str]:
        """GET /v1/models. Raises ApiUnavailable with a one-line reason if it cannot be used."""
        url = f"{self.base_url}/v1/models"
        try:
            async with asyncio.timeout(timeout_s), self.session.get(url, headers=self.headers) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            reason = f"no answer within {timeout_s:g}s" if isinstance(exc, TimeoutError) else _describe(exc)
            raise ApiUnavailable(
                f"cannot reach the BubbleTea API at {self.base_url}: {reason} (is `bubbletea up` running?)",
                retryable=True,
            ) from None
        body = json_or_none(text)
        if status != 200:
            raise ApiUnavailable(
                f"the BubbleTea API at {self.base_url} answered GET /v1/models with HTTP "
                f"{status}: {error_message(body, text)[:MAX_MESSAGE]}",
                retryable=status >= 500,
            )
        try:
            return [m["id"] for m in body["data"]]
        except (TypeError, KeyError):
            raise ApiUnavailable(f"GET {url} did not answer a model list: {text[:MAX_MESSAGE]!r}") from None

    async def wait_ready(self, timeout_s: float = 0.0, state: str | None = None) -> list[str]:
        """`list_models`, retried for up to `timeout_s` while the API is unreachable or answers
        5xx (it may be starting); 0 asks once. A 4xx or a malformed answer fails at once. With a
        wait, then also until GET /ready answers 200 (BubbleTea serves only while training runs;
        a server without /ready, 404, is taken as ready), and with `state`, until its answer names
        that serving state (``serving``: training runs, not only its workers set up)."""
        deadline = time.monotonic() + timeout_s
        models = await self._wait_models(deadline, timeout_s)
        if timeout_s > 0:
            await self._wait_serving(deadline, timeout_s, state)
        return models

    async def _wait_serving(self, deadline: float, timeout_s: float, state: str | None = None) -> None:
        url, last = f"{self.base_url}/ready", ""
        delays = poll_delays(READY_FIRST_S, READY_MAX_S)
        while True:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    async with self.session.get(url, headers=self.headers) as resp:
                        if resp.status == 404:
                            return
                        text = await resp.text()
                        body = json_or_none(text)
                        named = body.get("state") if isinstance(body, dict) else None
                        if resp.status == 200 and state in (None, named):
                            return
                        last = str(body.get("reason", text)) if isinstance(body, dict) else text
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last = _describe(exc) if not isinstance(exc, TimeoutError) else "no answer"
            delay = next(delays)
            if time.monotonic() + delay > deadline:
                raise ApiUnavailable(
                    f"the BubbleTea API at {self.base_url} is not ready to serve: {last[:MAX_MESSAGE]}; "
                    f"gave up after {timeout_s:g}s (--ready-check-timeout-sec)"
                )
            await asyncio.sleep(delay)

    async def _wait_models(self, deadline: float, timeout_s: float) -> list[str]:
        delays = poll_delays(READY_FIRST_S, READY_MAX_S)
        while True:
            # Each attempt within what is left of the wait (but at least a moment).
            left = deadline - time.monotonic()
            attempt_s = MODELS_TIMEOUT_S if timeout_s == 0 else min(MODELS_TIMEOUT_S, max(left, 0.1))
            try:
                return await self.list_models(attempt_s)
            except ApiUnavailable as exc:
                delay = next(delays)
                if exc.retryable and time.monotonic() + delay <= deadline:
                    await asyncio.sleep(delay)
                    continue
                if timeout_s > 0 and exc.retryable:
                    raise ApiUnavailable(f"{exc}; gave up after {timeout_s:g}s (--ready-check-timeout-sec)") from None
                raise

    # --- one request ---------------------------------------------------------------------------

    async def send(self, prompt: list[int], max_tokens: int = 1) -> Outcome:
        """Send one prompt asking for `max_tokens` tokens (completions only; the native API answers
        one) and wait for its result (or its failure) within the timeout."""
        if max_tokens != 1 and self.endpoint != "completions":
            raise ValueError(f"/v1/prefill answers one token; max_tokens {max_tokens} needs the completions endpoint")
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.endpoint == "native":
                    answer = await self._prefill(prompt)
                elif self.stream:
                    answer = await self._complete_streamed(prompt, max_tokens)
                else:
                    answer = await self._complete(prompt, max_tokens)
        except RequestFailed as f:
            return Outcome.failure(f.kind, f.message, len(prompt), f.status, after_s=time.perf_counter() - start)
        except TimeoutError:
            why = f"no result within {self.timeout_s:g}s (--timeout)"
            return Outcome.failure("timeout", why, len(prompt), after_s=time.perf_counter() - start)
        except (aiohttp.ClientConnectionError, OSError) as exc:  # refused, reset, server disconnected
            return Outcome.failure("connection_error", _describe(exc), len(prompt), after_s=time.perf_counter() - start)
        except aiohttp.ClientError as exc:  # anything else aiohttp raises (payload errors, ...)
            return Outcome.failure("client_error", _describe(exc), len(prompt), after_s=time.perf_counter() - start)
        # Not streamed: the whole answer is the first token and the last.
        end = time.perf_counter()
        first = answer.first_token_at if answer.first_token_at is not None else end
        last = answer.last_token_at if answer.last_token_at is not None else first
        return Outcome(
            True,
            answer.prompt_tokens,
            ttft_s=first - start,
            status=200,
            output_tokens=answer.output_tokens,
            latency_s=last - start,
            itls=answer.itls,
            streamed=answer.first_token_at is not None,
            server_ttft_s=answer.server_ttft_s,
        )

    def _body(self, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt}
        if self.model is not None:
            body["model"] = self.model
        if self.endpoint == "completions":
            # No `ignore_eos` (--ignore-eos is accepted but not sent): the served model has no
            # end-of-sequence token, so a completion runs to max_tokens unless a stop sequence hits.
            body["max_tokens"] = max_tokens
            if self.stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
        else:
            # The server fails the request at this deadline instead of computing a result that
            # nobody will read; ms, and at least 1 (the API's minimum).
            body["deadline_ms"] = max(1.0, self.timeout_s * 1000)
        return body

    async def _post(self, path: str, prompt: list[int], max_tokens: int = 1) -> tuple[int, Any, float | None]:
        """POST the prompt: the status, the body, and the server's own TTFT if it said (Server-Timing)."""
        body = self._body(prompt, max_tokens)
        async with self.session.post(f"{self.base_url}{path}", json=body, headers=self.headers) as resp:
            return resp.status, await _read(resp), server_ttft_s(resp.headers.get("Server-Timing"))

    async def _complete(self, prompt: list[int], max_tokens: int) -> Answer:
        """POST /v1/completions without streaming; the answer is the result (its output tokens are
        usage.completion_tokens)."""
        status, body, server_ttft = await self._post("/v1/completions", prompt, max_tokens)
        try:
            usage = body["usage"]
            completion = as_int(usage.get("completion_tokens")) or 0
            return Answer(int(usage["prompt_tokens"]), completion, server_ttft_s=server_ttft)
        except (TypeError, KeyError, ValueError, AttributeError):
            raise RequestFailed("bad_response", f"HTTP {status} without usage.prompt_tokens", status) from None

    async def _complete_streamed(self, prompt: list[int], max_tokens: int) -> Answer:
        """POST /v1/completions with `stream: true`, read as server-sent events to `[DONE]`."""
        url = f"{self.base_url}/v1/completions"
        async with self.session.post(url, json=self._body(prompt, max_tokens), headers=self.headers) as resp:
            status = resp.status
            if status >= 300 or resp.content_type != "text/event-stream":
                await _read(resp)  # raises the error status (or takes the 2xx JSON body)
                raise RequestFailed(
                    "bad_response",
                    f"HTTP {status} answered {resp.content_type}, not an event stream "
                    "(--no-stream reads a JSON answer)",
                    status,
                )
            tally = StreamTally(status, server_ttft_s(resp.headers.get("Server-Timing")))
            try:
                async for data in sse_data(resp.content):
                    if tally.feed(data, time.perf_counter()):
                        break
                else:
                    raise RequestFailed("client_error", "the event stream ended without data: [DONE]", status)
            except ValueError as exc:  # a line over aiohttp's limit, or bytes that are not UTF-8
                raise RequestFailed("bad_response", f"an unreadable event stream: {exc}", status) from None
        return tally.answer(len(prompt))

    async def _prefill(self, prompt: list[int]) -> Answer:
        """POST /v1/prefill, then poll GET /v1/prefill/{id} until done or failed."""
        status, body, _ = await self._post("/v1/prefill", prompt)
        request_id = body.get("id") if isinstance(body, dict) else None
        if not isinstance(request_id, str):
            raise RequestFailed("bad_response", f"HTTP {status} without a request id", status)
        url = f"{self.base_url}/v1/prefill/{request_id}"
        for delay in poll_delays():
            async with self.session.get(url, headers=self.headers) as resp:
                got, status = await _read(resp), resp.status
            state = got.get("status") if isinstance(got, dict) else None
            if state == "done":
                result = got.get("result")
                tokens = result.get("prompt_tokens") if isinstance(result, dict) else None
                return Answer(int(tokens) if isinstance(tokens, int) else len(prompt), 1)  # one token: a prefill
            if state == "failed":
                raise RequestFailed("failed", str(got.get("error") or "the server reports the prefill failed"), status)
            await asyncio.sleep(delay)  # queued (or any other not-yet-final state)
        raise AssertionError("unreachable: poll_delays is endless")


async def _read(resp: aiohttp.ClientResponse) -> Any:
    """The JSON body of a 2xx response; any other status becomes a failure named by its code."""
    text = await resp.text()
    body = json_or_none(text)
    if resp.status >= 300:
        raise RequestFailed(str(resp.status), error_message(body, text), resp.status)
    if body is None:
        raise RequestFailed(
            "bad_response", f"HTTP {resp.status} with a body that is not JSON: {text[:100]!r}", resp.status
        )
    return body


def _describe(exc: BaseException) -> str:
    """A readable one-liner for an exception (some aiohttp errors have an empty str())."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Its str() repeats host, port and "ssl:default"; the OS error is the informative part.
        return "connection refused" if isinstance(exc.os_error, ConnectionRefusedError) else str(exc.os_error)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
