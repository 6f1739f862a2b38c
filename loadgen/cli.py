"""The `loadgen` command and `run_benchmark`, the same run for code that calls it in-process.

A run: check the API answers (GET /v1/models, retried up to --ready-check-timeout-sec), send the
--num-warmups requests and wait for them, then send the workload on its arrival schedule, with at
most --max-concurrency requests in flight, and summarize what came back. The schedule is
open-loop, as in `vllm bench serve`: arrivals do not wait for earlier answers, so a slow server
sees its queue grow instead of the load generator politely slowing down and hiding it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
from tqdm import tqdm

from loadgen import arrivals, datasets, report, result
from loadgen.client import ApiUnavailable, PrefillClient, new_session
from loadgen.config import BenchmarkConfig
from loadgen.options import parse_config
from loadgen.outcome import Outcome

#: Independent random streams per purpose, so that changing the request rate does not change the
#: prompts (a rate sweep then compares like with like), and vice versa; nor does the output length.
ARRIVAL_STREAM, PROMPT_STREAM, OUTPUT_STREAM = 1, 2, 3
#: Exit codes: 0 the run completed (failed requests are reported, not fatal), 1 the API could
#: not be used, 2 a usage error (argparse's convention).
EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE = 0, 1, 2

T = TypeVar("T")


# --- the workload ------------------------------------------------------------------------------


class Request(NamedTuple):
    """One request of a workload: when it is sent (s after the start), its prompt's token ids and
    how many tokens it asks for (`max_tokens`; 1 is a prefill only)."""

    offset_s: float
    prompt: list[int]
    max_tokens: int = 1


@dataclass
class Workload:
    """The requests to send, lazily, in time order."""

    requests: Iterator[Request]
    total: int | None  # how many, if known in advance (for the progress bar)
    clamped: int = 0  # trace prompts cut to --max-input-len


def stream_rng(seed: int, stream: int) -> np.random.Generator:
    """The generator of one purpose (ARRIVAL_STREAM, PROMPT_STREAM, OUTPUT_STREAM) for a seed."""
    return np.random.default_rng([stream, seed])


def build_workload(config: BenchmarkConfig) -> Workload:
    """The same config always gives the same workload (prompts and schedule), so runs compare.
    Raises datasets.TraceError for an unreadable trace."""
    prompt_rng = stream_rng(config.seed, PROMPT_STREAM)
    if config.dataset == "trace":
        assert config.trace is not None  # validate() checked
        plan = datasets.plan_trace(
            datasets.read_trace(config.trace),
            time_scale=config.time_scale,
            max_input_len=config.max_input_len,
            duration_s=config.duration_s,
            limit=config.num_prompts,
            max_output_len=config.max_output_len,
        )
        planned = (datasets.random_tokens(n, prompt_rng) for n in plan.lengths)
        return Workload(map(Request, plan.offsets_s, planned, plan.output_lens), len(plan.offsets_s), plan.clamped)
    offsets = arrivals.arrival_offsets(config.request_rate, config.burstiness, stream_rng(config.seed, ARRIVAL_STREAM))
    if config.input_lens_from is not None:
        lengths = datasets.trace_lengths(datasets.read_trace(config.input_lens_from), config.max_input_len)
        prompts = datasets.prompts_of_lengths(lengths, prompt_rng)
    else:
        prompts = datasets.random_prompts(config.input_len, config.range_ratio, prompt_rng)
    outputs = datasets.random_output_lens(config.output_len, config.range_ratio, stream_rng(config.seed, OUTPUT_STREAM))
    requests: Iterator[Request] = map(Request, offsets, prompts, outputs)
    if config.duration_s is not None:
        limit = config.duration_s
        requests = itertools.takewhile(lambda r: r.offset_s < limit, requests)
    if config.num_prompts is not None:
        requests = itertools.islice(requests, config.num_prompts)
    return Workload(requests, config.num_prompts)


# --- running -----------------------------------------------------------------------------------


async def run_benchmark(config: BenchmarkConfig) -> dict[str, Any]:
    """Run one benchmark and return its result (the JSON `--json-out` and `--save-result` write,
    which it also writes when the config asks). Raises ValueError for a bad config,
    datasets.TraceError for a bad trace, ApiUnavailable if the API cannot be used; failed
    requests do not raise: they are counted in the result."""
    config.validate()
    result.check_metadata(config)
    workload = build_workload(config)
    async with new_session() as session:
        client = PrefillClient(
            session,
            config.base_url,
            endpoint=config.endpoint,
            model=config.model,
            api_key=config.api_key,
            timeout_s=config.timeout_s,
            stream=config.stream,
            headers=config.headers,
        )
        models = await client.wait_ready(config.ready_check_timeout_s, config.ready_state)
        if client.model is None and models:
            client.model = models[0]
        if config.num_warmups:
            await warm_up(client, workload, config)
        outcomes, duration_s = await drive(client, workload, config)
    summary = report.summarize(
        outcomes,
        duration_s,
        metrics=config.percentile_metrics,
        percentiles=config.metric_percentiles,
        goodput=config.goodput,
        clamped_prompts=workload.clamped,
    )
    run = result.assemble(
        config, summary, model=client.model, base_url=client.base_url, date=result.run_date(datetime.now())
    )
    for path in result.save_paths(config, run):
        await asyncio.to_thread(result.write, path, run)
    return run


class Sender(Protocol):
    """What `drive` needs of a client (a protocol, so tests can drive a stand-in)."""

    async def send(self, prompt: list[int], max_tokens: int = 1) -> Outcome: ...


async def warm_up(client: Sender, workload: Workload, config: BenchmarkConfig) -> None:
    """Send the workload's first request `num_warmups` times (at most --max-concurrency at once, as
    vLLM does) and wait for all of them; they are not measured and the workload is unchanged."""
    first = next(workload.requests, None)
    if first is None:
        return  # nothing to send at all
    workload.requests = itertools.chain([first], workload.requests)
    slots = asyncio.Semaphore(config.max_concurrency or config.num_warmups)

    async def one() -> None:
        async with slots:
            await client.send(first.prompt, first.max_tokens)

    async with asyncio.TaskGroup() as group:
        for _ in range(config.num_warmups):
            group.create_task(one())


async def drive(client: Sender, workload: Workload, config: BenchmarkConfig) -> tuple[list[Outcome], float]:
    """Send the workload on schedule; return the outcomes (in send order) and the duration from
    the first send to the last answer."""
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = tqdm(total=workload.total, disable=config.disable_tqdm, file=sys.stderr, unit="req", desc="loadgen")
    failed = 0

    async def one(request: Request) -> Outcome:
        nonlocal failed
        sent_at = time.time()
        try:
            outcome = replace(await client.send(request.prompt, request.max_tokens), sent_at=sent_at)
        finally:
            if slots is not None:
                slots.release()
        bar.update(1)
        if not outcome.ok:
            failed += 1
            bar.set_postfix_str(f"failed={failed}", refresh=False)
        return outcome

    tasks: list[asyncio.Task[Outcome]] = []
    start = time.perf_counter()
    stop_at = start + config.duration_s if config.duration_s is not None else math.inf
    try:
        async with asyncio.TaskGroup() as group:
            for request in workload.requests:
                due = start + request.offset_s
                if due >= stop_at:
                    break  # due after the end (workloads are in time order): do not wait for it
                # Sleep on the event loop's timer (about 1 ms resolution): good enough for arrival
                # times, and it leaves the CPU to the server when both run on one machine.
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if slots is not None:
                    # Waiting here rather than inside the task keeps at most max_concurrency tasks
                    # alive; a request delayed by the cap goes as soon as a slot frees (its TTFT
                    # counts from then, as in vLLM), and later arrivals keep their schedule.
                    await slots.acquire()
                if time.perf_counter() >= stop_at:
                    if slots is not None:
                        slots.release()
                    break
                tasks.append(group.create_task(one(request)))
    finally:
        bar.close()
    return [t.result() for t in tasks], time.perf_counter() - start


# --- the command line (options: loadgen/options.py) -----------------------------------------


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """uvloop when available: less client overhead per request, so the numbers are the server's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        run = run_loop(run_benchmark(config))
    except ApiUnavailable as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)  # argparse's prefix: one for every error
        return EXIT_UNAVAILABLE
    except datasets.TraceError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130
    print(report.format_summary(run))
    for path in result.save_paths(config, run):
        print(f"results written to {path}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
