"""The `loadgen` command line: every option, and how it becomes a `BenchmarkConfig`.

The options are `vllm bench serve`'s names for what loadgen does (--endpoint /v1/completions,
--dataset-name random, --random-input-len, --random-output-len, --save-result, ...), beside
loadgen's own older names, which keep working (--dataset, --input-len, --range-ratio, --endpoint
completions|native, --json-out).
Usage errors (conflicting options, bad values) exit 2 through argparse, naming the option.

Over 300 lines on purpose: one parser, so every option and its check are read in one place.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from loadgen import report, result
from loadgen.client import ENDPOINT_NAMES, endpoint_name, normalize_base_url
from loadgen.config import DEFAULT_BASE_URL, BenchmarkConfig

T = TypeVar("T")


DESCRIPTION = """\
Load generator for the BubbleTea API (modelled on `vllm bench serve`): sends prompts on a chosen
arrival schedule, measures the time to first token of each (and, when they ask for more than one
token with --random-output-len or --max-output-len, the time per output token and the inter-token
latencies), and prints a summary.

Prompts are random token ids (0..255; the model is byte-level). Arrivals are a gamma process
(--request-rate, --burstiness), or replay an Azure LLM inference trace (--trace). Failed
requests are counted by HTTP status or error class and reported, never hidden. See docs/loadgen.md.
"""

EPILOG = """\
examples:
  loadgen --request-rate 20 --num-prompts 500 --input-len 128 --range-ratio 0.5
  loadgen --endpoint /v1/completions --dataset-name random --random-input-len 128 --random-range-ratio 0.5 \\
      --request-rate 20 --num-prompts 500 --save-result --result-dir results --metadata run=1
  loadgen --request-rate 20 --burstiness 0.25 --duration 60 --goodput ttft:500
  loadgen --request-rate 5 --num-prompts 100 --random-input-len 128 --random-output-len 64 --goodput tpot:50
  loadgen --trace loadgen/traces/azure2023_conv_synthetic.csv --trace-speedup 10 --duration 60 --max-input-len 256
exit status: 0 the run completed (even with failed requests), 1 the API could not be used, 2 usage error
"""


class Renamed(argparse.Action):
    """An option's old spelling: it still works, and says once (on stderr) what it is called now.
    `--time-scale` meant the trace's speed-up here and the device time scale elsewhere
    (BUBBLETEA_TIME_SCALE, the benchmarks' --time-scale): one word for each idea."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        print(
            f"warning: {option} is now {self.new} (the trace's speed-up; the device time scale is "
            "BUBBLETEA_TIME_SCALE): the old spelling still works",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def _package_version() -> str:
    """The installed distribution's version (loadgen ships in the bubbletea distribution)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bubbletea")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    _server_options(p.add_argument_group("server"))
    _load_options(p.add_argument_group("load"))
    data = p.add_argument_group("dataset")
    _random_options(data)
    _trace_options(data)
    _result_options(p.add_argument_group("results"))
    return p


def _server_options(g: argparse._ArgumentGroup) -> None:
    """The server options: where requests go and how each is sent."""
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the API's address (default: {DEFAULT_BASE_URL})")
    g.add_argument(
        "--endpoint",
        choices=ENDPOINT_NAMES,
        default="/v1/completions",
        help="/v1/completions (or completions): the OpenAI completions API, streamed unless --no-stream "
        "(the default); /v1/prefill (or native): POST /v1/prefill, then poll GET /v1/prefill/{id} until done "
        "or failed",
    )
    g.add_argument("--model", help="the model to ask for (default: the first one GET /v1/models lists)")
    g.add_argument(
        "--api-key", help="sent as 'Authorization: Bearer KEY' (default: $BUBBLETEA_API_KEY, else $OPENAI_API_KEY)"
    )
    g.add_argument(
        "--header",
        nargs="+",
        metavar="KEY=VALUE",
        help="extra HTTP headers sent with every request, e.g. --header x-run=7 x-team=a (never recorded)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="give up on a request after this long; it counts as a 'timeout' error (default: 120)",
    )
    g.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        help="completions only: ask for server-sent events and take the TTFT at the first chunk with a choice, "
        "as vLLM does (the default); --no-stream reads one JSON answer and takes the TTFT when it is complete",
    )
    g.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        metavar="S",
        help="retry GET /v1/models for up to S seconds while the API is unreachable or answers 5xx; "
        "0 asks once (default: 0)",
    )
    g.add_argument(
        "--ready-state",
        metavar="STATE",
        help="with --ready-check-timeout-sec: start only once GET /ready names this serving state, e.g. "
        "serving (training runs; joining is taken as ready otherwise, its requests waiting for the first bubbles)",
    )


def _load_options(g: argparse._ArgumentGroup) -> None:
    """The load options: when requests are sent."""
    g.add_argument(
        "--request-rate",
        type=float,
        metavar="RPS",
        help="mean requests per second; inf sends every request at once (default: inf). Not with --trace",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        metavar="K",
        help="shape of the gamma distribution of inter-arrival times: 1 = Poisson, < 1 burstier, > 1 smoother; "
        "the mean rate stays --request-rate (default: 1.0). Not with --trace",
    )
    g.add_argument("--max-concurrency", type=int, metavar="N", help="at most N requests in flight (default: no limit)")
    g.add_argument(
        "--num-prompts",
        type=int,
        metavar="N",
        help="send N requests (default: 100, unless --duration is given; with both, whichever ends first)",
    )
    g.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="send until this much time has passed; with --trace, replay the part of the trace within it",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default: 0)")
    g.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        metavar="N",
        help="first send the first prompt N times and wait for the answers; not measured (default: 0)",
    )


def _random_options(g: argparse._ArgumentGroup) -> None:
    """The dataset options of random prompts (and which dataset)."""
    g.add_argument(
        "--dataset-name",
        "--dataset",
        dest="dataset",
        choices=("random", "trace"),
        help="random: random prompts of --random-input-len tokens (the default); trace: the one --trace names",
    )
    g.add_argument(
        "--random-input-len",
        "--input-len",
        dest="input_len",
        type=int,
        metavar="TOKENS",
        help="mean prompt length (default: 128)",
    )
    g.add_argument(
        "--random-range-ratio",
        "--range-ratio",
        dest="range_ratio",
        type=float,
        metavar="R",
        help="prompt lengths are uniform integers in [floor(len*(1-R)), ceil(len*(1+R))] (as vLLM), at least 1; "
        "0 <= R < 1 (default: 0.0)",
    )
    g.add_argument(
        "--random-output-len",
        dest="output_len",
        type=int,
        metavar="TOKENS",
        help="mean max_tokens asked for: uniform integers in [floor(len*(1-R)), ceil(len*(1+R))] with R the "
        "--random-range-ratio (as vLLM), at least 1; 1 is exactly 1 (default: 1, prefill only)",
    )
    g.add_argument(
        "--input-lens-from",
        metavar="TRACE",
        help="random dataset: draw each prompt's length from this Azure trace CSV's ContextTokens (seeded, with "
        "replacement), clamped to --max-input-len; arrivals stay --request-rate's. Not with --input-len",
    )


def _trace_options(g: argparse._ArgumentGroup) -> None:
    """The dataset options of a replayed trace, and what is asked of each request."""
    g.add_argument(
        "--trace",
        metavar="FILE",
        help="replay an Azure LLM inference trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens): arrivals follow "
        "its timestamps, prompt lengths its ContextTokens",
    )
    g.add_argument(
        "--trace-speedup",
        dest="time_scale",
        type=float,
        metavar="X",
        help="replay the trace X times faster (default: 1.0). Only with --trace",
    )
    g.add_argument(
        "--time-scale",
        dest="time_scale",
        type=float,
        action=Renamed,
        new="--trace-speedup",
        help=argparse.SUPPRESS,  # the old spelling: it works, with a warning
    )
    g.add_argument(
        "--max-input-len",
        type=int,
        metavar="TOKENS",
        help="clamp trace prompts to this length, counting how many were cut (default: 256). Only with --trace "
        "or --input-lens-from",
    )
    g.add_argument(
        "--max-output-len",
        type=int,
        metavar="TOKENS",
        help="ask each trace request for its GeneratedTokens, clamped to [1, TOKENS] "
        "(default: 1, prefill only). Only with --trace",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="accepted for vLLM's command lines and recorded, not sent: the served model has no end-of-sequence "
        "token, so a completion always runs to max_tokens unless a stop sequence ends it",
    )


def _result_options(g: argparse._ArgumentGroup) -> None:
    """The results options: what is reported and where it is saved."""
    g.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="service-level objectives, e.g. ttft:500 tpot:50: a request is good if it succeeded within every "
        "one; reports good requests per second (metrics: ttft, tpot, e2el; a request with one output token "
        "meets any tpot objective, as in vLLM)",
    )
    g.add_argument(
        "--percentile-metrics",
        default=",".join(report.DEFAULT_METRICS),
        metavar="LIST",
        help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el (for a prefill, max_tokens "
        "1, the end-to-end latency is the TTFT and there is no tpot nor itl) (default: ttft,tpot,itl)",
    )
    g.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        metavar="LIST",
        help="comma-separated percentiles to report (default: 50,90,99)",
    )
    g.add_argument(
        "--save-result",
        action="store_true",
        help="write the results as JSON, named as vLLM does: "
        "{label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json",
    )
    g.add_argument(
        "--result-dir", metavar="DIR", help="with --save-result: the folder (created if needed; default: here)"
    )
    g.add_argument("--result-filename", metavar="NAME", help="with --save-result: the file name instead")
    g.add_argument(
        "--metadata",
        nargs="+",
        metavar="KEY=VALUE",
        help="pairs added to the result JSON's top level, e.g. --metadata version=0.3 tp=1",
    )
    g.add_argument(
        "--label", help="recorded as 'label', and the saved file's name starts with it (default: the backend)"
    )
    g.add_argument("--json-out", metavar="FILE", help="also write the results as JSON to FILE")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


#: Options that only make sense for one dataset: given with the other, they are a usage error
#: rather than silently ignored.
RANDOM_ONLY = {
    "request_rate": "--request-rate",
    "burstiness": "--burstiness",
    "input_len": "--random-input-len/--input-len",
    "range_ratio": "--random-range-ratio/--range-ratio",
    "output_len": "--random-output-len",
}
TRACE_ONLY = {"time_scale": "--trace-speedup", "max_input_len": "--max-input-len", "max_output_len": "--max-output-len"}


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchmarkConfig:
    """Check the options together and build the config; usage errors exit via parser.error (2)."""
    if args.dataset == "trace" and args.trace is None:
        parser.error("--dataset trace needs --trace FILE")
    if args.dataset == "random" and args.trace is not None:
        parser.error("--dataset random and --trace conflict: --trace replays a trace")
    dataset = "trace" if args.trace is not None else "random"
    foreign = dict(TRACE_ONLY if dataset == "random" else RANDOM_ONLY)
    if args.input_lens_from is not None:
        if dataset == "trace":
            parser.error("--input-lens-from applies to the random dataset: --trace sets the lengths itself")
        if args.input_len is not None or args.range_ratio is not None:
            parser.error("--input-lens-from and --input-len/--range-ratio conflict: the trace gives the lengths")
        del foreign["max_input_len"]
    for attr, flag in foreign.items():
        if getattr(args, attr) is not None:
            if dataset == "trace":
                parser.error(f"{flag} does not apply with --trace: the trace sets arrival times and lengths")
            parser.error(f"{flag} applies only with --trace")
    endpoint = endpoint_name(args.endpoint)
    if endpoint == "native" and args.stream is not None:
        parser.error(f"--{'' if args.stream else 'no-'}stream applies only to the completions endpoint")
    try:
        config = BenchmarkConfig(
            base_url=normalize_base_url(args.base_url),
            endpoint=endpoint,
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
            output_len=_default(args.output_len, 1),
            trace=args.trace,
            input_lens_from=args.input_lens_from,
            time_scale=_default(args.time_scale, 1.0),
            max_input_len=_default(args.max_input_len, 256),
            max_output_len=_default(args.max_output_len, 1),
            ignore_eos=args.ignore_eos,
            goodput=report.parse_goodput(args.goodput) if args.goodput else None,
            percentile_metrics=report.parse_metrics(args.percentile_metrics),
            metric_percentiles=report.parse_percentiles(args.metric_percentiles),
            seed=args.seed,
            json_out=args.json_out,
            timeout_s=args.timeout,
            disable_tqdm=args.disable_tqdm,
            stream=_default(args.stream, True),
            headers=parse_pairs(args.header or [], "--header"),
            ready_check_timeout_s=args.ready_check_timeout_sec,
            ready_state=args.ready_state,
            num_warmups=args.num_warmups,
            save_result=args.save_result,
            result_dir=args.result_dir,
            result_filename=args.result_filename,
            metadata=parse_pairs(args.metadata or [], "--metadata"),
            label=args.label,
        )
        config.validate()
        result.check_metadata(config)
    except ValueError as exc:
        parser.error(str(exc))
    return config


def parse_pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    """['a=1', 'b = x=y'] -> {'a': '1', 'b': 'x=y'}: split at the first '=', both sides stripped
    (as vLLM reads --header and --metadata); a later key replaces an earlier one."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r} is not KEY=VALUE")
        pairs[key.strip()] = value.strip()
    return pairs


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def parse_config(argv: Sequence[str] | None = None) -> BenchmarkConfig:
    """The config the command line describes (exits 2 on a usage error)."""
    parser = build_parser()
    return config_from_args(parser.parse_args(argv), parser)
