"""The `loadgen` command and `run_benchmark`, the same run for code that calls it in-process.

A run: check the API answers (GET /v1/models), then send the workload on its arrival schedule,
with at most --max-concurrency requests in flight, and summarize what came back. The schedule is
open-loop, as in `vllm bench serve`: arrivals do not wait for earlier answers, so a slow server
sees its queue grow instead of the load generator politely slowing down and hiding it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
from tqdm import tqdm

from loadgen import arrivals, datasets, report
from loadgen.client import ENDPOINTS, ApiUnavailable, Outcome, PrefillClient, new_session, normalize_base_url

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
#: Independent random streams per purpose, so that changing the request rate does not change the
#: prompts (a rate sweep then compares like with like), and vice versa.
ARRIVAL_STREAM, PROMPT_STREAM = 1, 2
#: Exit codes: 0 the run completed (failed requests are reported, not fatal), 1 the API could
#: not be used, 2 a usage error (argparse's convention).
EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE = 0, 1, 2

T = TypeVar("T")


@dataclass
class BenchmarkConfig:
    """Everything a run needs. Built by the CLI from its options, or directly by other code."""

    base_url: str = DEFAULT_BASE_URL
    endpoint: str = "completions"
    model: str | None = None  # None: the first model GET /v1/models lists
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = 100  # None: only duration_s limits the run
    duration_s: float | None = None
    dataset: str = "random"  # or "trace"
    input_len: int = 128
    range_ratio: float = 0.0
    trace: str | None = None
    time_scale: float = 1.0
    max_input_len: int = 256
    goodput: dict[str, float] | None = None  # metric -> limit in ms
    percentile_metrics: list[str] = field(default_factory=lambda: ["ttft"])
    metric_percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    seed: int = 0
    json_out: str | None = None
    timeout_s: float = 120.0
    disable_tqdm: bool = False

    def validate(self) -> None:
        """Raise ValueError with a readable reason for a configuration that cannot run."""
        self._validate_load()
        self._validate_dataset()
        self._validate_results()

    def _validate_load(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"the endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        arrivals.validate(self.request_rate, self.burstiness)
        _check(self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be >= 1")
        _check(self.num_prompts is None or self.num_prompts >= 1, "--num-prompts must be >= 1")
        _check(self.duration_s is None or self.duration_s > 0, "--duration must be > 0")
        _check(self.num_prompts is not None or self.duration_s is not None, "give --num-prompts or --duration")
        _check(self.timeout_s > 0, "--timeout must be > 0")
        _check(self.seed >= 0, "--seed must be >= 0")

    def _validate_dataset(self) -> None:
        if self.dataset == "random":
            datasets.length_range(self.input_len, self.range_ratio)
            # Everything at once, for as long as the duration, with no cap: an endless burst.
            endless = self.num_prompts is None and math.isinf(self.request_rate) and self.max_concurrency is None
            _check(not endless, "--duration with an infinite --request-rate needs --max-concurrency (or a finite rate)")
        elif self.dataset == "trace":
            _check(self.trace is not None, "the trace dataset needs --trace FILE")
            _check(math.isfinite(self.time_scale) and self.time_scale > 0, "--time-scale must be > 0")
            _check(self.max_input_len >= 1, "--max-input-len must be >= 1")
        else:
            raise ValueError(f"unknown dataset {self.dataset!r}: choose random or trace")

    def _validate_results(self) -> None:
        for metric in [*self.percentile_metrics, *(self.goodput or {})]:
            _check(metric in report.METRICS, f"unknown metric {metric!r}; choose from {', '.join(report.METRICS)}")
        _check(all(0 <= p <= 100 for p in self.metric_percentiles), "percentiles must be within 0..100")
        if self.json_out is not None:
            # Checked before the run, so a typo does not cost the results at the end of it.
            parent = Path(self.json_out).parent
            _check(parent.is_dir(), f"--json-out: the directory {parent} does not exist")

    def describe(self) -> dict[str, Any]:
        """The configuration as recorded with the results: JSON-safe, and without the API key."""
        d = asdict(self)
        # The summary reports these itself (goodput_slos_ms, ...): "goodput" there is the result.
        for key in ("api_key", "disable_tqdm", "goodput", "percentile_metrics", "metric_percentiles"):
            del d[key]
        # "duration_s" in the results is the measured duration; the limit gets its own name.
        d["duration_limit_s"] = d.pop("duration_s")
        # JSON has no infinity; "inf" is what vLLM writes too.
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        if self.dataset == "trace":
            for key in ("request_rate", "burstiness", "input_len", "range_ratio"):
                d[key] = None  # not used: the trace decides arrivals and lengths
        else:
            d["trace"] = d["time_scale"] = d["max_input_len"] = None
        return d


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# --- the workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    """The requests to send, lazily: (send time in s after the start, prompt token ids)."""

    requests: Iterator[tuple[float, list[int]]]
    total: int | None  # how many, if known in advance (for the progress bar)
    clamped: int = 0  # trace prompts cut to --max-input-len


def stream_rng(seed: int, stream: int) -> np.random.Generator:
    """The generator of one purpose (ARRIVAL_STREAM, PROMPT_STREAM) for a seed."""
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
        )
        prompts = (datasets.random_tokens(n, prompt_rng) for n in plan.lengths)
        return Workload(zip(plan.offsets_s, prompts, strict=False), len(plan.offsets_s), plan.clamped)
    offsets = arrivals.arrival_offsets(config.request_rate, config.burstiness, stream_rng(config.seed, ARRIVAL_STREAM))
    requests: Iterator[tuple[float, list[int]]] = zip(
        offsets, datasets.random_prompts(config.input_len, config.range_ratio, prompt_rng), strict=False
    )
    if config.duration_s is not None:
        limit = config.duration_s
        requests = itertools.takewhile(lambda r: r[0] < limit, requests)
    if config.num_prompts is not None:
        requests = itertools.islice(requests, config.num_prompts)
    return Workload(requests, config.num_prompts)


# --- running -----------------------------------------------------------------------------------


async def run_benchmark(config: BenchmarkConfig) -> dict[str, Any]:
    """Run one benchmark and return its summary (the JSON --json-out writes, which it also
    writes when config.json_out is set). Raises ValueError for a bad config, datasets.TraceError
    for a bad trace, ApiUnavailable if the API cannot be used; failed requests do not raise:
    they are counted in the summary."""
    config.validate()
    workload = build_workload(config)
    async with new_session() as session:
        client = PrefillClient(
            session,
            config.base_url,
            endpoint=config.endpoint,
            model=config.model,
            api_key=config.api_key,
            timeout_s=config.timeout_s,
        )
        models = await client.list_models()
        if client.model is None and models:
            client.model = models[0]
        outcomes, duration_s = await drive(client, workload, config)
    summary = report.summarize(
        outcomes,
        duration_s,
        metrics=config.percentile_metrics,
        percentiles=config.metric_percentiles,
        goodput=config.goodput,
        clamped_prompts=workload.clamped,
    )
    settings = {**config.describe(), "base_url": client.base_url, "model": client.model}
    clash = settings.keys() & summary.keys()
    assert not clash, f"configuration keys would overwrite results: {clash}"
    result = {**summary, **settings}
    if config.json_out is not None:
        await asyncio.to_thread(write_json, config.json_out, result)
    return result


def write_json(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


class Sender(Protocol):
    """What `drive` needs of a client (a protocol, so tests can drive a stand-in)."""

    async def send(self, prompt: list[int]) -> Outcome: ...


async def drive(client: Sender, workload: Workload, config: BenchmarkConfig) -> tuple[list[Outcome], float]:
    """Send the workload on schedule; return the outcomes (in send order) and the duration from
    the first send to the last answer."""
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = tqdm(total=workload.total, disable=config.disable_tqdm, file=sys.stderr, unit="req", desc="loadgen")
    failed = 0

    async def one(prompt: list[int]) -> Outcome:
        nonlocal failed
        try:
            outcome = await client.send(prompt)
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
            for offset, prompt in workload.requests:
                due = start + offset
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
                tasks.append(group.create_task(one(prompt)))
    finally:
        bar.close()
    return [t.result() for t in tasks], time.perf_counter() - start


# --- the command line --------------------------------------------------------------------------

DESCRIPTION = """\
Load generator for the BubbleTea prefill API (modelled on `vllm bench serve`): sends prompts on
a chosen arrival schedule, measures the time to first token of each, and prints a summary.

Prompts are random token ids (0..255; the model is byte-level). Arrivals are a gamma process
(--request-rate, --burstiness), or replay an Azure LLM inference trace (--trace). Failed
requests are counted by HTTP status or error class and reported, never hidden. See docs/loadgen.md.
"""

EPILOG = """\
examples:
  loadgen --request-rate 20 --num-prompts 500 --input-len 128 --range-ratio 0.5
  loadgen --request-rate 20 --burstiness 0.25 --duration 60 --goodput ttft:500
  loadgen --trace AzureLLMInferenceTrace_conv.csv --time-scale 10 --duration 60 --max-input-len 256
exit status: 0 the run completed (even with failed requests), 1 the API could not be used, 2 usage error
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the API's address (default: {DEFAULT_BASE_URL})")
    server.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="completions",
        help="completions: POST /v1/completions, answered when the result is ready (OpenAI, the default); "
        "native: POST /v1/prefill, then poll GET /v1/prefill/{id} until done or failed",
    )
    server.add_argument("--model", help="the model to ask for (default: the first one GET /v1/models lists)")
    server.add_argument(
        "--api-key", help="sent as 'Authorization: Bearer KEY' (default: $BUBBLETEA_API_KEY, else $OPENAI_API_KEY)"
    )
    server.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="give up on a request after this long; it counts as a 'timeout' error (default: 120)",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        metavar="RPS",
        help="mean requests per second; inf sends every request at once (default: inf). Not with --trace",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        metavar="K",
        help="shape of the gamma distribution of inter-arrival times: 1 = Poisson, < 1 burstier, > 1 smoother; "
        "the mean rate stays --request-rate (default: 1.0). Not with --trace",
    )
    load.add_argument(
        "--max-concurrency", type=int, metavar="N", help="at most N requests in flight (default: no limit)"
    )
    load.add_argument(
        "--num-prompts",
        type=int,
        metavar="N",
        help="send N requests (default: 100, unless --duration is given; with both, whichever ends first)",
    )
    load.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="send until this much time has passed; with --trace, replay the part of the trace within it",
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default: 0)")

    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        choices=("random", "trace"),
        help="random: random prompts of --input-len tokens (the default); trace: the one --trace names",
    )
    data.add_argument("--input-len", type=int, metavar="TOKENS", help="mean prompt length (default: 128)")
    data.add_argument(
        "--range-ratio",
        type=float,
        metavar="R",
        help="prompt lengths are uniform in [input_len*(1-R), input_len*(1+R)], at least 1; 0 <= R < 1 (default: 0.0)",
    )
    data.add_argument(
        "--trace",
        metavar="FILE",
        help="replay an Azure LLM inference trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens): arrivals follow "
        "its timestamps, prompt lengths its ContextTokens",
    )
    data.add_argument(
        "--time-scale",
        type=float,
        metavar="X",
        help="replay the trace X times faster (default: 1.0). Only with --trace",
    )
    data.add_argument(
        "--max-input-len",
        type=int,
        metavar="TOKENS",
        help="clamp trace prompts to this length, counting how many were cut (default: 256). Only with --trace",
    )

    out = p.add_argument_group("results")
    out.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="service-level objectives, e.g. ttft:500: a request is good if it succeeded within every one; "
        "reports good requests per second (metrics: ttft, e2el)",
    )
    out.add_argument(
        "--percentile-metrics",
        default="ttft",
        metavar="LIST",
        help="comma-separated metrics to report percentiles of: ttft, e2el (for a prefill-only service "
        "the end-to-end latency is the TTFT) (default: ttft)",
    )
    out.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        metavar="LIST",
        help="comma-separated percentiles to report (default: 50,90,99)",
    )
    out.add_argument("--json-out", metavar="FILE", help="also write the results as JSON to FILE")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


#: Options that only make sense for one dataset: given with the other, they are a usage error
#: rather than silently ignored.
RANDOM_ONLY = {
    "request_rate": "--request-rate",
    "burstiness": "--burstiness",
    "input_len": "--input-len",
    "range_ratio": "--range-ratio",
}
TRACE_ONLY = {"time_scale": "--time-scale", "max_input_len": "--max-input-len"}


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchmarkConfig:
    """Check the options together and build the config; usage errors exit via parser.error (2)."""
    if args.dataset == "trace" and args.trace is None:
        parser.error("--dataset trace needs --trace FILE")
    if args.dataset == "random" and args.trace is not None:
        parser.error("--dataset random and --trace conflict: --trace replays a trace")
    dataset = "trace" if args.trace is not None else "random"
    foreign = TRACE_ONLY if dataset == "random" else RANDOM_ONLY
    for attr, flag in foreign.items():
        if getattr(args, attr) is not None:
            if dataset == "trace":
                parser.error(f"{flag} does not apply with --trace: the trace sets arrival times and prompt lengths")
            parser.error(f"{flag} applies only with --trace")
    try:
        config = BenchmarkConfig(
            base_url=normalize_base_url(args.base_url),
            endpoint=args.endpoint,
            model=args.model,
            api_key=args.api_key or os.environ.get("BUBBLETEA_API_KEY") or os.environ.get("OPENAI_API_KEY") or None,
            request_rate=_default(args.request_rate, math.inf),
            burstiness=_default(args.burstiness, 1.0),
            max_concurrency=args.max_concurrency,
            num_prompts=args.num_prompts if args.num_prompts is not None or args.duration is not None else 100,
            duration_s=args.duration,
            dataset=dataset,
            input_len=_default(args.input_len, 128),
            range_ratio=_default(args.range_ratio, 0.0),
            trace=args.trace,
            time_scale=_default(args.time_scale, 1.0),
            max_input_len=_default(args.max_input_len, 256),
            goodput=report.parse_goodput(args.goodput) if args.goodput else None,
            percentile_metrics=report.parse_metrics(args.percentile_metrics),
            metric_percentiles=report.parse_percentiles(args.metric_percentiles),
            seed=args.seed,
            json_out=args.json_out,
            timeout_s=args.timeout,
            disable_tqdm=args.disable_tqdm,
        )
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return config


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def parse_config(argv: Sequence[str] | None = None) -> BenchmarkConfig:
    """The config the command line describes (exits 2 on a usage error)."""
    parser = build_parser()
    return config_from_args(parser.parse_args(argv), parser)


def _run_loop(main: Coroutine[Any, Any, T]) -> T:
    """uvloop when available: less client overhead per request, so the numbers are the server's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        result = _run_loop(run_benchmark(config))
    except ApiUnavailable as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except datasets.TraceError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return 130
    print(report.format_summary(result))
    if config.json_out is not None:
        print(f"results written to {config.json_out}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
