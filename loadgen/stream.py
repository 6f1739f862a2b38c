"""Reading a streamed completion as `vllm bench serve` does (pure but for the line source).

The body is server-sent events: `data: {...}` chunks, the usage chunk (`choices: []`) that
`stream_options.include_usage` asks for, then `data: [DONE]`. The first token is the first chunk
that carries a choice: vLLM's rule, under which its text may be empty and a usage-only chunk is not
a token. Each later chunk with a choice adds one inter-token latency (the gap since the previous
one, however many tokens the chunk carries, as vLLM counts them), and the last one ends the
end-to-end latency. The output tokens are the usage chunk's `completion_tokens`, else one per
chunk with a choice. The request succeeded if such a chunk came and the stream ended with
`[DONE]`; an `{"error": ...}` event fails it under the event's `code` (an HTTP status).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from loadgen.outcome import Answer, RequestFailed, error_message


async def sse_data(lines: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The `data` of each server-sent event, from the body's lines: an event ends at a blank line,
    its `data:` lines are joined with newlines, comments (`:` keep-alives) and other fields are
    skipped. An event the stream ends in the middle of is still given."""
    data: list[str] = []
    async for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


class StreamTally:
    """What a completions event stream said so far (pure: fed the `data` of each event)."""

    def __init__(self, status: int, server_ttft_s: float | None = None) -> None:
        self.status = status  # the HTTP status the stream came with
        self.server_ttft_s = server_ttft_s  # the server's own TTFT, from its Server-Timing header
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.itls: list[float] = []  # seconds between successive chunks with a choice
        self.choices = 0  # chunks with a choice: tokens when the server does not count them
        self.prompt_tokens: int | None = None
        self.output_tokens = 0

    def feed(self, data: str, now: float) -> bool:
        """Take one event's data seen at `now`; True at `[DONE]`. An error event, or one that is not
        a JSON object, raises RequestFailed: the first under its `code` (an HTTP status)."""
        if data == "[DONE]":
            return True
        event = json_or_none(data)
        if not isinstance(event, dict):
            raise RequestFailed("bad_response", f"an event that is not a JSON object: {data[:100]!r}", self.status)
        if (err := event.get("error")) is not None:
            code = as_int(err.get("code")) if isinstance(err, dict) else None
            if code is None:
                raise RequestFailed("failed", error_message(event, data), self.status)
            raise RequestFailed(str(code), error_message(event, data), code)
        if event.get("choices"):  # a token, even if its text is empty (vLLM's rule)
            self.choices += 1
            if self.last_token_at is None:
                self.first_token_at = now
            else:
                self.itls.append(now - self.last_token_at)
            self.last_token_at = now
        if isinstance(usage := event.get("usage"), dict):  # the include_usage chunk (choices: [])
            self.prompt_tokens = as_int(usage.get("prompt_tokens"))
            self.output_tokens = as_int(usage.get("completion_tokens")) or 0
        return False

    def answer(self, sent_tokens: int) -> Answer:
        """The result once `[DONE]` came; a stream without a token is a failure."""
        if self.first_token_at is None:
            raise RequestFailed(
                "bad_response", "the event stream ended without a chunk with a choice (no token)", self.status
            )
        prompt_tokens = self.prompt_tokens if self.prompt_tokens is not None else sent_tokens
        return Answer(
            prompt_tokens,
            self.output_tokens or self.choices,
            self.first_token_at,
            last_token_at=self.last_token_at,
            itls=tuple(self.itls),
            server_ttft_s=self.server_ttft_s,
        )


#: The `ttft` metric of a `Server-Timing` header (W3C: `name;dur=ms;desc="..."`, comma-separated).
_SERVER_TTFT = re.compile(r'(?:^|,)\s*ttft\s*;(?:[^,;]*;)*?\s*dur\s*=\s*"?([0-9]+(?:\.[0-9]*)?)')


def server_ttft_s(header: str | None) -> float | None:
    """The server's own time to first token from a `Server-Timing` header (its `ttft` metric's
    `dur`, ms), in seconds; None when absent (other servers, vLLM, do not send it)."""
    found = _SERVER_TTFT.search(header) if header else None
    return float(found.group(1)) / 1000 if found else None


def json_or_none(text: str) -> Any:
    """The JSON value of `text`, or None if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def as_int(value: Any) -> int | None:
    """An integer from a JSON body (a bool is not one), or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
