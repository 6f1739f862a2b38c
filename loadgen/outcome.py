"""What one request ends as: an `Outcome` (never an exception), its successful `Answer` on the way,
and `RequestFailed`, a classified failure raised inside the request code and turned into an
Outcome by `PrefillClient.send`.

Error classes are what a reader of the report needs to tell apart: the server's HTTP status
("429", "504", ...), or the client's own "timeout", "connection_error", "client_error" (another
aiohttp failure, or a stream cut before `data: [DONE]`) and "bad_response" (a 2xx the client could
not use). A native request the server reports as failed counts as "failed"; so does a streamed
error event that carries no status code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Longest error message kept per request: enough to read the server's explanation.
MAX_MESSAGE = 300


@dataclass(frozen=True)
class Outcome:
    """What happened to one request. `ttft_s` is from just before the request was sent to its first
    token (the first streamed chunk with a choice, or the whole answer when not streaming);
    `latency_s` to its last token (the last streamed chunk with a choice, as vLLM times it, or the
    whole answer), and `itls` the gaps between successive chunks with a choice (one entry per chunk,
    however many tokens it carries, as vLLM counts them). `streamed` says the token times were seen:
    without it the time per output token cannot be measured."""

    ok: bool
    prompt_tokens: int  # as the server counted them when it answered, else as sent
    ttft_s: float | None = None  # set when ok
    status: int | None = None  # the last HTTP status seen, None if no response
    error: str | None = None  # the error class when not ok: "429", "timeout", ...
    message: str = ""  # the server's or the client's explanation
    output_tokens: int = 0  # usage.completion_tokens, else the chunks with a choice; 0: not said
    latency_s: float | None = None  # end to end when ok (None: the same as ttft_s); to the failure when not
    itls: tuple[float, ...] = ()  # seconds between successive chunks with a choice
    streamed: bool = False  # the answer was streamed: each chunk's time is known
    sent_at: float = 0.0  # when it was sent, wall clock (Unix seconds; 0: not said)
    server_ttft_s: float | None = None  # the server's own TTFT (its Server-Timing header), when it says

    @property
    def e2el_s(self) -> float | None:
        """The end-to-end latency: from the send to the last token."""
        return self.latency_s if self.latency_s is not None else self.ttft_s

    @staticmethod
    def failure(
        kind: str, message: str, prompt_tokens: int, status: int | None = None, after_s: float | None = None
    ) -> Outcome:
        """A failed request; `after_s`: from its send to the failure (a 429's answer, a timeout)."""
        message = message[:MAX_MESSAGE]
        return Outcome(False, prompt_tokens, status=status, error=kind, message=message, latency_s=after_s)


@dataclass(frozen=True)
class Answer:
    """What a successful request returned, before it is timed into an Outcome."""

    prompt_tokens: int
    output_tokens: int = 0
    first_token_at: float | None = None  # perf_counter of the first token when streamed
    last_token_at: float | None = None  # perf_counter of the last chunk with a choice when streamed
    itls: tuple[float, ...] = ()  # seconds between successive chunks with a choice when streamed
    server_ttft_s: float | None = None  # the server's own TTFT (its Server-Timing header), when it says


class RequestFailed(Exception):
    """A classified failure (`kind` is the error class), carried out of the request code to
    `PrefillClient.send`, which turns it into an Outcome: it never leaves the client."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status


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
