"""vLLM alone against BubbleTea prefill with vLLM decode, at the same open-loop Poisson load.

One vLLM server (CPU, float32, prefix caching off, with the BubbleTea KV connector: bench/lib/vllm_stack.py)
and one `bubbletea up --decode vllm --vllm-url URL` in front of it (PP=2 x DP=2 training with a
device profile, prefilling in its bubbles: `vllm_stack.serving_spec`). Two arms share that vLLM:

* ``vllm_alone``: POST vLLM's /v1/completions directly (vLLM prefills and decodes);
* ``bubbletea_vllm``: POST the front door's /v1/completions (the prompt is prefilled in a training
  bubble, its first token sampled there; vLLM loads the KV cache and decodes the rest).

Both arms send the same requests at the same times: Poisson arrivals at ``--rate`` requests per
second for ``--duration`` seconds (seeded), open loop (no cap on requests in flight), each a prompt
of random token ids 1..999 (never 0, the model's end of sequence) of a length uniform in
``--prompt-min``..``--prompt-max``, ``--max-tokens`` output tokens, temperature 0, ignore_eos,
streamed (with ``stream_options.include_usage``). The arms run in alternation, vllm then
bubbletea, ``--pairs`` times, never at once; a few warm-up requests to each go first, uncounted.
The default rate, 2/s, is one both arms carry on 2 cores with room to spare: at 1, 2, 4 and 8/s
every request was answered on both, while the wait for a bubble grew from 80 to 135, 213 and
763 ms (docs/benchmarks.md).

Per request, on the host wall clock (the load generator's monotonic clock, real ms; vLLM is not
stretched by the time scale, so nothing here is divided by it):

* ttft: sending to the first streamed chunk carrying text (`visible`: a completion whose tokens
  are all pieces of unfinished characters, which the tiny model's random weights sometimes
  sample, has none on either arm: it counts as answered, in ``answered_without_text``, and stays
  out of the TTFT and TPOT percentiles, in the e2e ones);
* e2e: sending to ``data: [DONE]``;
* tpot: (e2e - ttft) / (tokens - 1), tokens as the stream's usage chunk counts them.

Every request sent counts. A non-200 status (``http_NNN``), an error event in the stream
(``error_event``), no answer within ``--request-timeout`` (``timeout``), a connection error
(``connection``), a stream that ends without ``[DONE]`` (``early_end``), without a usage count
(``no_usage``) or with fewer tokens than asked (``short_N``) is failed, counted by kind per arm;
the latency percentiles are over the answered requests only, with ``answered`` and ``sent`` beside
them.

Prefill tokens taken off vLLM: vLLM's ``vllm:prompt_tokens_by_source_total`` read before and after
each arm. ``prefill_tokens_off_vllm_share`` = ``external_kv_transfer`` tokens (loaded by the
connector) / prompt tokens sent in the bubbletea arm (1.0 when every request was answered);
``vllm_local_compute_per_request`` = ``local_compute`` tokens / requests sent in that arm (1 is
expected: vLLM computes only the position of the first token the bubbles sampled).

Diagnostics per pair (host real ms, means over the arm from the services' own histograms):
the front door's ``bubble_queue_mean_ms`` (submission to the prefill starting in a bubble) and
``bubble_prefill_mean_ms``; vLLM's ``vllm_queue_mean_ms`` and ``vllm_prefill_mean_ms`` (its
prefill phase: in the bubbletea arm, loading the KV cache and computing one position);
``second_chunk_p50_ms`` per arm (sending to the second chunk with text: in the bubbletea arm, the
hop to vLLM and its first step); ``sent_late_max_ms`` (the load generator's worst lateness against
the schedule) and ``host_load_1m`` (the machine's load average after the arm: the machine may be
shared); ``machine_busy_share``, ``vllm_cpu_s`` and ``bubbletea_cpu_s``: where the CPU went while the
arm ran (`bench/lib/cpu_time.py`; training runs in both arms, and without a GPU the bubbles share vLLM's cores).

    python bench/pd_vllm.py --quick          # 20 s per arm, 1 pair (a few minutes, vLLM's start included)
    python bench/pd_vllm.py                  # 60 s per arm, 2 pairs
    python bench/pd_vllm.py --rate 1 --model /path/to/llama

Prints a table on stderr, then one JSON line last on stdout: each arm's figures (requests pooled over
every pair), the ratios bubbletea / vllm alone (the median over pairs of each pair's ratio), the
share of prefill tokens taken off vLLM, and the per-pair figures. Every key names its unit (``_ms``:
host wall clock, real ms; ``_rps``: requests per real second; ``_ratio``, ``_share``: ratios).
Exits 2, saying why, when vLLM's environment (`make vllm`) is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib import cpu_time, pd_sweep, vllm_stack  # noqa: E402
from bench.lib.pd_load import Outcome, arm, arrivals, one, prompts  # noqa: E402
from shared.figures.percentiles import percentile  # noqa: E402

ARMS = ("vllm_alone", "bubbletea_vllm")
#: Warm-up requests per arm before the first pair (uncounted): vLLM's first steps, the front
#: door's first forward, the workers' first prefill.
WARMUP = 3
#: The prompt-token counter vLLM keeps by where each prompt position came from.
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
#: The longest prompt the serving spec takes (`prefill.max_prompt_tokens`); vLLM's context is 512.
MAX_PROMPT = 256
#: The process trees this bench starts, by what their command line holds (`bench.lib.cpu_time.used`).
CPU_TREES = {"vllm": "vllm.entrypoints", "bubbletea": "bubbletea.cli"}


# ---- the figures (pure) ----


def _ms(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v * 1000, digits)


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """One arm's figures: latency percentiles over the answered requests (host real ms), counts of
    every request sent, and the failed ones by kind."""
    ok = [o for o in outcomes if o.failed is None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]  # an answer without text has none
    second = [o.second_s for o in ok if o.second_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    tpot = [x for x in (o.tpot_s for o in ok) if x is not None]
    return {
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50), 2),
        "tpot_p99_ms": _ms(percentile(tpot, 99), 2),
        "e2e_p50_ms": _ms(percentile(e2e, 50)),
        "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "second_chunk_p50_ms": _ms(percentile(second, 50)),
        "answered": len(ok),
        "answered_without_text": sum(1 for o in ok if o.ttft_s is None),
        "sent": len(outcomes),
        "failed": dict(sorted(Counter(o.failed for o in outcomes if o.failed).items())),
    }


FIGURES = ("ttft_p50", "ttft_p99", "tpot_p50", "e2e_p99")


def ratios(alone: dict[str, Any], ours: dict[str, Any]) -> dict[str, float | None]:
    """Each figure's bubbletea / vllm-alone ratio (None where either side has none)."""
    out: dict[str, float | None] = {}
    for f in FIGURES:
        a, b = alone[f + "_ms"], ours[f + "_ms"]
        out[f + "_ratio"] = round(b / a, 3) if a and b is not None else None
    return out


def median_of(values: list[float | None], digits: int = 3) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got), digits) if got else None


def time_scale(log_text: str) -> float | None:
    """The device time scale k `bubbletea up` said it runs at ("device time scale K ..."), or None."""
    m = re.search(r"device time scale ([0-9]+(?:\.[0-9]+)?)", log_text)
    return float(m.group(1)) if m else None


def result(
    pairs: list[dict[str, Any]], outcomes: dict[str, list[Outcome]], *, k: float | None, args: argparse.Namespace
) -> dict[str, Any]:
    """The JSON line: each arm pooled over every pair, the ratios and token shares as medians over pairs."""
    alone, ours = summary(outcomes[ARMS[0]]), summary(outcomes[ARMS[1]])
    out: dict[str, Any] = {
        "bench": "pd_vllm",
        "clock": "host wall",
        "time_scale": k,
        "rate_rps": args.rate,
        "duration_s": args.duration,
        "prompt_tokens_range": [args.prompt_min, args.prompt_max],
        "max_tokens": args.max_tokens,
        "sent_per_arm": pairs[0]["sent"] if pairs else 0,
        ARMS[0]: alone,
        ARMS[1]: ours,
    }
    for key in (f + "_ratio" for f in FIGURES):
        out[key] = median_of([p[key] for p in pairs])
    for key in ("prefill_tokens_off_vllm_share", "vllm_local_compute_per_request", "vllm_alone_local_share"):
        out[key] = median_of([p[key] for p in pairs], 4)
    for key in ("bubble_queue_mean_ms", "bubble_prefill_mean_ms"):
        out[key] = median_of([p[key] for p in pairs], 1)
    out["pairs"] = pairs
    return out


# ---- the run ----


async def _settled(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """A counter once it stops moving (vLLM publishes its stats a step after a request ends)."""
    last = await vllm_stack.metric(http, url, name, **labels)
    for _ in range(20):
        await asyncio.sleep(0.5)
        now = await vllm_stack.metric(http, url, name, **labels)
        if now == last:
            return now
        last = now
    return last


async def _mean_s(http: aiohttp.ClientSession, url: str, name: str, before: tuple[float, float]) -> float | None:
    s = await vllm_stack.metric(http, url, name + "_sum") - before[0]
    n = await vllm_stack.metric(http, url, name + "_count") - before[1]
    return s / n if n else None


async def _hist(http: aiohttp.ClientSession, url: str, name: str) -> tuple[float, float]:
    return await vllm_stack.metric(http, url, name + "_sum"), await vllm_stack.metric(http, url, name + "_count")


HISTOGRAMS = {  # (where, name) -> the per-pair key: means over one arm, host real ms
    ("front", "bubbletea:request_queue_time_seconds"): "bubble_queue_mean_ms",
    ("front", "bubbletea:request_prefill_time_seconds"): "bubble_prefill_mean_ms",
    ("vllm", "vllm:request_queue_time_seconds"): "vllm_queue_mean_ms",
    ("vllm", "vllm:request_prefill_time_seconds"): "vllm_prefill_mean_ms",
}


async def run_arm(
    http: aiohttp.ClientSession,
    name: str,
    urls: dict[str, str],
    times: list[float],
    ps: list[list[int]],
    args: argparse.Namespace,
) -> tuple[list[Outcome], dict[str, Any]]:
    """One arm, with vLLM's prompt-token counters and the services' histograms read around it."""
    vllm = urls["vllm"]
    target = vllm if name == ARMS[0] else urls["front"]
    ext0 = await _settled(http, vllm, BY_SOURCE, source="external_kv_transfer")
    loc0 = await _settled(http, vllm, BY_SOURCE, source="local_compute")
    hists = {key: await _hist(http, urls[where], h) for (where, h), key in HISTOGRAMS.items()}
    cpu0 = cpu_time.sample()
    t0 = time.perf_counter()
    outcomes, late = await arm(http, target, times, ps, args.max_tokens, args.request_timeout)
    wall = time.perf_counter() - t0
    cpu = cpu_time.used(cpu0, cpu_time.sample(), CPU_TREES)
    ext = await _settled(http, vllm, BY_SOURCE, source="external_kv_transfer") - ext0
    loc = await _settled(http, vllm, BY_SOURCE, source="local_compute") - loc0
    figures: dict[str, Any] = {"wall_s": round(wall, 1), "sent_late_max_ms": _ms(late)}
    figures["host_load_1m"] = round(os.getloadavg()[0], 2)  # the machine's 1-minute load average after the arm
    figures |= cpu
    for (where, h), key in HISTOGRAMS.items():
        if where == "front" and name == ARMS[0]:
            continue
        figures[key] = _ms(await _mean_s(http, urls[where], h, hists[key]))
    figures["external_kv_tokens"] = int(ext)
    figures["local_compute_tokens"] = int(loc)
    return outcomes, figures


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def bench(
    urls: dict[str, str], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, list[Outcome]]]:
    times = arrivals(args.rate, args.duration, args.seed)
    ps = prompts(len(times), args.prompt_min, args.prompt_max, args.seed)
    prompt_tokens = sum(len(p) for p in ps)
    pooled: dict[str, list[Outcome]] = {a: [] for a in ARMS}
    pairs = []
    conn = aiohttp.TCPConnector(limit=0)  # open loop: no cap on requests in flight
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        warm = prompts(WARMUP, args.prompt_min, args.prompt_max, args.seed + 99)
        for name in ARMS:
            url = urls["vllm"] if name == ARMS[0] else urls["front"]
            got = [await one(http, url, p, args.max_tokens, args.request_timeout) for p in warm]
            _say(f"  warm-up {name}: {sum(o.failed is None for o in got)}/{len(got)} answered")
        for i in range(args.pairs):
            pair: dict[str, Any] = {"pair": i + 1, "sent": len(times), "prompt_tokens_sent": prompt_tokens}
            for name in ARMS:
                _say(f"  pair {i + 1}/{args.pairs}: {name}, {len(times)} requests over {args.duration:g} s")
                outcomes, figures = await run_arm(http, name, urls, times, ps, args)
                pooled[name] += outcomes
                pair[name] = {**summary(outcomes), **figures}
            a, b = pair[ARMS[0]], pair[ARMS[1]]
            pair |= ratios(a, b)
            pair["prefill_tokens_off_vllm_share"] = round(b["external_kv_tokens"] / prompt_tokens, 4)
            pair["vllm_local_compute_per_request"] = round(b["local_compute_tokens"] / len(times), 3)
            pair["vllm_alone_local_share"] = round(a["local_compute_tokens"] / prompt_tokens, 4)
            pair["bubble_queue_mean_ms"] = b["bubble_queue_mean_ms"]
            pair["bubble_prefill_mean_ms"] = b["bubble_prefill_mean_ms"]
            pairs.append(pair)
    return pairs, pooled


def table(res: dict[str, Any]) -> str:
    rows = [f"{'':<22} {'vllm alone':>12} {'bubbletea+vllm':>15} {'ratio':>8}"]
    a, b = res[ARMS[0]], res[ARMS[1]]
    for f in FIGURES:
        rows.append(f"{f + ' (ms)':<22} {a[f + '_ms']!s:>12} {b[f + '_ms']!s:>15} {res[f + '_ratio']!s:>8}")
    rows.append(f"{'second chunk p50 (ms)':<22} {a['second_chunk_p50_ms']!s:>12} {b['second_chunk_p50_ms']!s:>15}")
    got = [f"{x['answered']}/{x['sent']}" for x in (a, b)]
    rows.append(f"{'answered / sent':<22} {got[0]:>12} {got[1]:>15}")
    rows.append(f"{'failed':<22} {json.dumps(a['failed']):>12} {json.dumps(b['failed']):>15}")
    rows.append(
        f"prefill tokens off vLLM: {res['prefill_tokens_off_vllm_share']} of those sent; vLLM computed "
        f"{res['vllm_local_compute_per_request']} prompt token(s) a request "
        f"(alone: {res['vllm_alone_local_share']} of them)"
    )
    rows.append(
        f"bubbletea: waited {res['bubble_queue_mean_ms']} ms for a bubble, prefilled in "
        f"{res['bubble_prefill_mean_ms']} ms (means, host ms); time scale k = {res['time_scale']}"
    )
    return "\n".join(rows)


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally`: the servers stop


def serve_and_run(args: argparse.Namespace, python: Path) -> tuple[Any, float | None, bool]:
    """vLLM, `bubbletea up` in front of it, the pairs (or the sweep); everything stopped on the way
    out, Ctrl-C included. What the pairs (the sweep) gave, the time scale `up` ran at, and whether
    it said it stopped cleanly."""
    with contextlib.ExitStack() as stack:
        work = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        if args.model:
            model = Path(args.model).resolve()
        else:
            _say("pd_vllm: making a tiny Llama")
            model = vllm_stack.make_tiny_llama(work / "tiny-llama")
        t0 = time.perf_counter()
        _say(f"pd_vllm: starting vLLM ({python}) on {model.name}")
        vllm = stack.enter_context(vllm_stack.vllm_server(python, model, work / "vllm.log", nice=args.vllm_nice))
        _say(f"pd_vllm: vLLM at {vllm} after {time.perf_counter() - t0:.0f} s; starting bubbletea up --decode vllm")
        spec = vllm_stack.serving_spec(work, model, request_timeout_s=args.request_timeout)
        up_log = work / "up" / "up.log"
        stopped: dict[str, bool] = {}

        # runs once `up` is stopped (the stack unwinds in reverse), before a temporary folder goes
        def said_stopped() -> None:
            stopped["clean"] = up_log.exists() and "==> stopped cleanly" in up_log.read_text("utf-8", "replace")

        stack.callback(said_stopped)
        objective = ("--ttft-objective-ms", str(args.ttft_objective_ms))  # placement auto: vLLM is the decoder
        up = vllm_stack.bubbletea_up(spec, work / "up", "--decode", "vllm", "--vllm-url", vllm, *objective)
        front = stack.enter_context(up)
        k = time_scale(up_log.read_text(errors="replace"))
        _say(f"pd_vllm: front door at {front} (device time scale {k}); load {args.rate:g}/s for {args.duration:g} s")
        urls = {"vllm": vllm, "front": front}
        got = asyncio.run(pd_sweep.sweep(urls, args, run_arm, summary, _say) if args.sweep else bench(urls, args))
    return got, k, stopped.get("clean", False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="--duration 20 and --pairs 1 (unless given)")
    ap.add_argument("--rate", type=float, default=2.0, metavar="RPS", help="Poisson arrivals per second; default 2")
    ap.add_argument("--duration", type=float, metavar="S", help="seconds of arrivals per arm; default 60, quick 20")
    ap.add_argument("--pairs", type=int, metavar="N", help="vllm, bubbletea pairs in alternation; default 2, quick 1")
    ap.add_argument("--prompt-min", type=int, default=16, metavar="TOKENS", help="shortest prompt; default 16")
    ap.add_argument("--prompt-max", type=int, default=200, metavar="TOKENS", help="longest prompt; default 200")
    ap.add_argument("--max-tokens", type=int, default=16, metavar="N", help="output tokens a request; default 16")
    ap.add_argument("--seed", type=int, default=2026, help="the arrivals' and prompts' seed; default 2026")
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="a request unanswered after S seconds counts as failed (timeout); default 120",
    )
    ap.add_argument(
        "--model",
        metavar="DIR",
        help="an HF Llama-family checkpoint directory for both vLLM and the bubbles "
        "(default: a tiny seeded Llama made in a temporary directory)",
    )
    ap.add_argument("--keep", metavar="DIR", help="run in DIR and keep the logs (vllm.log, up/up.log) there")
    pd_sweep.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.sweep:
        os.environ.setdefault("BUBBLETEA_TIME_SCALE", "1")  # k = 1: the objective's device ms are real ms
    args.duration = args.duration if args.duration is not None else (20.0 if args.quick else 60.0)
    args.pairs = args.pairs if args.pairs is not None else (1 if args.quick else 2)
    if args.pairs < 1 or args.rate <= 0 or args.duration <= 0:
        ap.error("--pairs, --rate and --duration must be positive")
    if not 1 <= args.prompt_min <= args.prompt_max <= MAX_PROMPT:
        ap.error(f"prompt lengths must satisfy 1 <= --prompt-min <= --prompt-max <= {MAX_PROMPT}")
    if args.max_tokens < 2:
        ap.error("--max-tokens must be at least 2 (time per output token needs a second token)")
    python = vllm_stack.vllm_python()
    if python is None:
        _say(
            "pd_vllm: skipped: vLLM's environment is missing (`make vllm` builds .venv-vllm; "
            "or set BUBBLETEA_VLLM_PYTHON to its python)"
        )
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C stops everything, also when this was started with SIGINT ignored (in the background of a
    # shell without job control): what it starts would inherit that, and `up` would not stop on it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.perf_counter()
    try:
        got, k, clean = serve_and_run(args, python)
    except KeyboardInterrupt:
        _say("pd_vllm: interrupted; everything it started is stopped")
        return 130
    res = pd_sweep.result(got, k, args) if args.sweep else result(*got, k=k, args=args)
    res["bench_s"] = round(time.perf_counter() - t0, 1)
    res["host_cpus"] = os.cpu_count()
    # `up` said it stopped cleanly: false when it had died before the end (its services, in its
    # process group, were stopped all the same)
    res["up_stopped_cleanly"] = clean
    if not clean:
        where = Path(args.keep) / "up" / "up.log" if args.keep else "--keep DIR keeps it"
        _say(f"pd_vllm: warning: bubbletea up did not say it stopped cleanly (its log: {where})")
    _say(pd_sweep.table(res) if args.sweep else table(res))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
