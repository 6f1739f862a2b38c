"""Sending one request to the prefill API and recording what happened.

Every request ends in an `Outcome`, never an exception: a load test must count failures, not
stop at the first one. Errors are classified by what a reader of the report needs to tell apart:
the server's HTTP status ("429", "504", ...), or the client's own "timeout", "connection_error",
"client_error" (another aiohttp failure) and "bad_response" (a 2xx the client could not read).
A native request the server reports as failed counts as "failed".
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

ENDPOINTS = ("completions", "native")
#: Native status polling: start fast (a prefill can take a few ms), back off so thousands of
#: waiting requests do not turn into a flood of GETs that competes with the work measured.
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05
#: Longest error message kept per request: enough to read the server's explanation.
MAX_MESSAGE = 300


class ApiUnavailable(Exception):
    """The API cannot be used at all (unreachable, or refuses us): the run does not start."""


@dataclass(frozen=True)
class Outcome:
    """What happened to one request. `ttft_s` is from just before the request was sent to the
    moment its result was seen; for a prefill-only service that is also the end-to-end latency."""

    ok: bool
    prompt_tokens: int  # as the server counted them when it answered, else as sent
    ttft_s: float | None = None  # set when ok
    status: int | None = None  # the last HTTP status seen, None if no response
    error: str | None = None  # the error class when not ok: "429", "timeout", ...
    message: str = ""  # the server's or the client's explanation

    @staticmethod
    def failure(kind: str, message: str, prompt_tokens: int, status: int | None = None) -> Outcome:
        return Outcome(False, prompt_tokens, status=status, error=kind, message=message[:MAX_MESSAGE])


class _Failed(Exception):
    """Internal: carries a classified failure out of nested request code to one handler."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status


def poll_delays(first: float = POLL_FIRST_S, cap: float = POLL_MAX_S) -> Iterator[float]:
    """Sleeps between status polls: `first`, doubling, capped at `cap`, forever."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


def error_message(body: Any, text: str) -> str:
    """The explanation in an error response: the OpenAI shape's error.message when present,
    otherwise the raw body (a proxy's HTML page is still better than nothing)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    return text.strip() or "(empty body)"


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
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"the endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        self.session = session
        self.base_url = normalize_base_url(base_url)
        self.endpoint = endpoint
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # --- start-up check ------------------------------------------------------------------------

    async def list_models(self, timeout_s: float = 10.0) -> list[str]:
        """GET /v1/models. Raises ApiUnavailable with a one-line reason if it cannot be used."""
        url = f"{self.base_url}/v1/models"
        try:
            async with asyncio.timeout(timeout_s), self.session.get(url, headers=self.headers) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            reason = f"no answer within {timeout_s:g}s" if isinstance(exc, TimeoutError) else _describe(exc)
            raise ApiUnavailable(
                f"cannot reach the BubbleTea API at {self.base_url}: {reason} (is `bubbletea up` running?)"
            ) from None
        body = _json_or_none(text)
        if status != 200:
            raise ApiUnavailable(
                f"the BubbleTea API at {self.base_url} answered GET /v1/models with HTTP "
                f"{status}: {error_message(body, text)[:MAX_MESSAGE]}"
            )
        try:
            return [m["id"] for m in body["data"]]
        except (TypeError, KeyError):
            raise ApiUnavailable(f"GET {url} did not answer a model list: {text[:MAX_MESSAGE]!r}") from None

    # --- one request ---------------------------------------------------------------------------

    async def send(self, prompt: list[int]) -> Outcome:
        """Send one prompt and wait for its result (or its failure) within the timeout."""
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.endpoint == "completions":
                    prompt_tokens = await self._complete(prompt)
                else:
                    prompt_tokens = await self._prefill(prompt)
        except _Failed as f:
            return Outcome.failure(f.kind, f.message, len(prompt), f.status)
        except TimeoutError:
            return Outcome.failure("timeout", f"no result within {self.timeout_s:g}s (--timeout)", len(prompt))
        except (aiohttp.ClientConnectionError, OSError) as exc:  # refused, reset, server disconnected
            return Outcome.failure("connection_error", _describe(exc), len(prompt))
        except aiohttp.ClientError as exc:  # anything else aiohttp raises (payload errors, ...)
            return Outcome.failure("client_error", _describe(exc), len(prompt))
        return Outcome(True, prompt_tokens, ttft_s=time.perf_counter() - start, status=200)

    def _body(self, prompt: list[int]) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt}
        if self.model is not None:
            body["model"] = self.model
        if self.endpoint == "completions":
            body["max_tokens"] = 1
        else:
            # The server fails the request at this deadline instead of computing a result that
            # nobody will read; ms, and at least 1 (the API's minimum).
            body["deadline_ms"] = max(1.0, self.timeout_s * 1000)
        return body

    async def _post(self, path: str, prompt: list[int]) -> tuple[int, Any]:
        async with self.session.post(f"{self.base_url}{path}", json=self._body(prompt), headers=self.headers) as resp:
            return resp.status, await _read(resp)

    async def _complete(self, prompt: list[int]) -> int:
        """POST /v1/completions; the answer is the result. Returns the prompt's token count."""
        status, body = await self._post("/v1/completions", prompt)
        try:
            return int(body["usage"]["prompt_tokens"])
        except (TypeError, KeyError, ValueError):
            raise _Failed("bad_response", f"HTTP {status} without usage.prompt_tokens", status) from None

    async def _prefill(self, prompt: list[int]) -> int:
        """POST /v1/prefill, then poll GET /v1/prefill/{id} until done or failed."""
        status, body = await self._post("/v1/prefill", prompt)
        request_id = body.get("id") if isinstance(body, dict) else None
        if not isinstance(request_id, str):
            raise _Failed("bad_response", f"HTTP {status} without a request id", status)
        url = f"{self.base_url}/v1/prefill/{request_id}"
        for delay in poll_delays():
            async with self.session.get(url, headers=self.headers) as resp:
                got, status = await _read(resp), resp.status
            state = got.get("status") if isinstance(got, dict) else None
            if state == "done":
                result = got.get("result")
                tokens = result.get("prompt_tokens") if isinstance(result, dict) else None
                return int(tokens) if isinstance(tokens, int) else len(prompt)
            if state == "failed":
                raise _Failed("failed", str(got.get("error") or "the server reports the prefill failed"), status)
            await asyncio.sleep(delay)  # queued (or any other not-yet-final state)
        raise AssertionError("unreachable: poll_delays is endless")


async def _read(resp: aiohttp.ClientResponse) -> Any:
    """The JSON body of a 2xx response; any other status becomes a failure named by its code."""
    text = await resp.text()
    body = _json_or_none(text)
    if resp.status >= 300:
        raise _Failed(str(resp.status), error_message(body, text), resp.status)
    if body is None:
        raise _Failed("bad_response", f"HTTP {resp.status} with a body that is not JSON: {text[:100]!r}", resp.status)
    return body


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _describe(exc: BaseException) -> str:
    """A readable one-liner for an exception (some aiohttp errors have an empty str())."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Its str() repeats host, port and "ssl:default"; the OS error is the informative part.
        return "connection refused" if isinstance(exc.os_error, ConnectionRefusedError) else str(exc.os_error)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
