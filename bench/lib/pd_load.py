"""bench/pd_vllm.py's load: the seeded schedule and prompts both arms share, and one streamed
request as the load generator sends and times it (host wall clock). The arms' figures are in
pd_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.lib import vllm_stack


def arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) at `rate` per second within `duration_s`."""
    if rate <= 0 or duration_s <= 0:
        return []
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids 1..999 (never 0: end of sequence), lengths uniform in lo..hi."""
    rng = random.Random(seed + 1)
    return [[rng.randrange(1, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- one request ----


@dataclass
class Outcome:
    """One request as the load generator saw it (host monotonic seconds from its sending)."""

    failed: str | None = None  # the kind of failure; None: answered
    ttft_s: float | None = None
    second_s: float | None = None  # the second chunk carrying text
    e2e_s: float | None = None
    tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.failed or self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)


def visible(text: Any) -> bool:
    """Text a reader sees: not empty, not only U+FFFD. A token that is part of a character decodes
    to nothing until the character completes; at the end vLLM drops an unfinished one and the
    front door sends it as U+FFFD, so a completion of unfinished characters only has no text on
    either."""
    return isinstance(text, str) and bool(text.replace("\ufffd", ""))


def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": vllm_stack.MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, timeout_s: float) -> Outcome:
    """POST one streamed completion to `url` and time it; every way it can fail is an Outcome."""
    t0 = time.perf_counter()
    out = Outcome()
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(f"{url}/v1/completions", json=body(prompt, max_tokens)) as resp:
                if resp.status != 200:
                    await resp.read()
                    return Outcome(failed=f"http_{resp.status}")
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        event = json.loads(data)
                    except ValueError:
                        return Outcome(failed="bad_event")
                    if not isinstance(event, dict) or "error" in event:
                        return Outcome(failed="error_event")
                    now = time.perf_counter() - t0
                    for ch in event.get("choices") or ():
                        if ch.get("finish_reason") == "error":
                            return Outcome(failed="error_event")
                        if visible(ch.get("text")):
                            if out.ttft_s is None:
                                out.ttft_s = now
                            elif out.second_s is None:
                                out.second_s = now
                    usage = event.get("usage")
                    if usage:
                        out.tokens = int(usage.get("completion_tokens") or 0)
    except TimeoutError:
        return Outcome(failed="timeout")
    except aiohttp.ClientError:
        return Outcome(failed="connection")
    out.e2e_s = time.perf_counter() - t0
    if not done:
        out.failed = "early_end"
    elif not out.tokens:
        out.failed = "no_usage"
    elif out.tokens < max_tokens:
        out.failed = f"short_{out.tokens}"
    return out


async def arm(
    http: aiohttp.ClientSession, url: str, times: list[float], ps: list[list[int]], max_tokens: int, timeout_s: float
) -> tuple[list[Outcome], float]:
    """Every request of the schedule, each sent at its time (open loop); their outcomes and the
    most any was sent late (s)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    late = 0.0
    for at, p in zip(times, ps, strict=True):
        wait = start + at - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        late = max(late, loop.time() - start - at)
        tasks.append(asyncio.create_task(one(http, url, p, max_tokens, timeout_s)))
    return list(await asyncio.gather(*tasks)), late
