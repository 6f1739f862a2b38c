"""`bench/pd_vllm.py --sweep`: vLLM alone against BubbleTea + vLLM (`prefill.placement: auto`) from a
light load to past the bubbles' capacity, at one TTFT objective.

Per offered load (Poisson, open loop, the same seeded arrivals and prompts on both arms, the arms in
turn, never at once), for each arm: TTFT p50 and p99 over the answered requests; SLO attainment,
the share of the requests *sent* whose first token came within the TTFT objective (a failed or
unanswered request misses it); goodput, the requests per second of the arm's schedule that met both
the TTFT objective and the TPOT objective; the failures by kind (a 429 is ``http_429``). For the
BubbleTea arm, the share of the prompt tokens sent that were computed in the bubbles: vLLM's
``external_kv_transfer`` prompt tokens (loaded from the bubbles' caches) over those sent; the rest
vLLM computed itself (a moved prompt) or nobody did (a refused one).

The clock is the host's wall clock (real ms); the objective is the front door's, in device ms, and
the bench runs `bubbletea up` at time scale k = 1 (``BUBBLETEA_TIME_SCALE``) unless told another, so
device ms are real ms. Every request sent counts.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib.pd_load import Outcome, arrivals, one, prompts

#: Offered loads (requests/s) of a default sweep: from light to past what the bubbles hold on two
#: cores (about 8/s with the tiny Llama, docs/benchmarks.md) and into where vLLM alone falls behind.
SWEEP_RATES = (1.0, 2.0, 4.0, 8.0, 12.0, 16.0)

RunArm = Callable[..., Awaitable[tuple[list[Outcome], dict[str, Any]]]]


def attainment(outcomes: list[Outcome], objective_s: float) -> float | None:
    """Of the requests sent, the share answered with a first token within `objective_s`."""
    met = sum(1 for o in outcomes if o.failed is None and o.ttft_s is not None and o.ttft_s <= objective_s)
    return round(met / len(outcomes), 4) if outcomes else None


def goodput_rps(outcomes: list[Outcome], objective_s: float, tpot_s: float, duration_s: float) -> float:
    """Requests per second of the schedule that met the TTFT objective and the TPOT objective."""
    good = sum(
        1
        for o in outcomes
        if o.failed is None
        and o.ttft_s is not None
        and o.ttft_s <= objective_s
        and (o.tpot_s is None or o.tpot_s <= tpot_s)
    )
    return round(good / duration_s, 3)


def point(
    rate: float,
    arms: dict[str, tuple[list[Outcome], dict[str, Any]]],
    summary: Callable[[list[Outcome]], dict],
    prompt_tokens: int,
    objective_s: float,
    tpot_s: float,
    duration_s: float,
) -> dict[str, Any]:
    """One load's figures, both arms side by side."""
    out: dict[str, Any] = {"rate_rps": rate}
    for name, (outcomes, figures) in arms.items():
        s = summary(outcomes)
        out[name] = {
            "ttft_p50_ms": s["ttft_p50_ms"],
            "ttft_p99_ms": s["ttft_p99_ms"],
            "tpot_p50_ms": s["tpot_p50_ms"],
            "slo_attainment": attainment(outcomes, objective_s),
            "goodput_rps": goodput_rps(outcomes, objective_s, tpot_s, duration_s),
            "sent": s["sent"],
            "answered": s["answered"],
            "answered_without_text": s["answered_without_text"],  # no time to first text: a miss
            "failed": s["failed"],
            "sent_late_max_ms": figures.get("sent_late_max_ms"),
            "wall_s": figures.get("wall_s"),  # the arm's first sending to its last answer
            "host_load_1m": figures.get("host_load_1m"),
            # where the machine's CPU went while the arm ran (bench/lib/cpu_time.py): the cores are shared
            **{k: figures.get(k) for k in ("machine_busy_share", "vllm_cpu_s", "bubbletea_cpu_s")},
        }
        if name == "bubbletea_vllm":
            out[name]["bubble_token_share"] = round(figures["external_kv_tokens"] / prompt_tokens, 4)
            out[name]["vllm_local_compute_tokens"] = figures["local_compute_tokens"]
    return out


async def sweep(
    urls: dict[str, str],
    args: Any,
    run_arm: RunArm,
    summary: Callable[[list[Outcome]], dict],
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Every load of `args.sweep_rates`, each arm once, in turn."""
    objective_s, tpot_s = args.ttft_objective_ms / 1000, args.tpot_objective_ms / 1000
    points = []
    conn = aiohttp.TCPConnector(limit=0)  # open loop: no cap on requests in flight
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        warm = prompts(3, args.prompt_min, args.prompt_max, args.seed + 99)
        for name, url in (("vllm_alone", urls["vllm"]), ("bubbletea_vllm", urls["front"])):
            got = [await one(http, url, p, args.max_tokens, args.request_timeout) for p in warm]
            say(f"  warm-up {name}: {sum(o.failed is None for o in got)}/{len(got)} answered")
        for i, rate in enumerate(args.sweep_rates):
            times = arrivals(rate, args.duration, args.seed + i)
            ps = prompts(len(times), args.prompt_min, args.prompt_max, args.seed + i)
            arms = {}
            for name in ("vllm_alone", "bubbletea_vllm"):
                say(f"  load {rate:g}/s: {name}, {len(times)} requests over {args.duration:g} s")
                arms[name] = await run_arm(http, name, urls, times, ps, args)
            p = point(rate, arms, summary, sum(len(x) for x in ps), objective_s, tpot_s, args.duration)
            say("    " + json.dumps(p))
            points.append(p)
    return points


def verdicts(points: list[dict[str, Any]], objective_ms: float) -> dict[str, Any]:
    """The issue's targets over the sweep (docs/vllm.md states them): each true or false, or None
    where no point qualifies (a verdict over the points where vLLM alone meets the objective, when
    it meets it nowhere, is not true: issue 62)."""
    slo: bool | None = None if not points else True
    p99: bool | None = None
    no_429: bool | None = None
    lost = 0
    for p in points:
        a, b = p["vllm_alone"], p["bubbletea_vllm"]
        slo = bool(slo) and (b["slo_attainment"] or 0) >= (a["slo_attainment"] or 0) - 0.01
        if a["ttft_p99_ms"] is not None and a["ttft_p99_ms"] <= objective_ms:
            p99 = (p99 is not False) and b["ttft_p99_ms"] is not None and b["ttft_p99_ms"] <= objective_ms
            no_429 = (no_429 is not False) and not b["failed"].get("http_429")
        lost += sum(n for kind, n in b["failed"].items() if kind != "http_429")
    return {
        "slo_attainment_within_0_01_everywhere": slo,
        "ttft_p99_within_objective_where_vllm_alone_is": p99,
        "no_429_where_vllm_alone_meets_objective": no_429,
        "failed_other_than_429": lost,
    }


def picture(points: list[dict[str, Any]], path: Path, objective_ms: float) -> Path:
    """Goodput of both arms and the bubbles' share of the prompt tokens, against the offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [p["rate_rps"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [p["vllm_alone"]["goodput_rps"] for p in points], "o-", label="vLLM alone: goodput")
    ax.plot(rates, [p["bubbletea_vllm"]["goodput_rps"] for p in points], "s-", label="BubbleTea + vLLM: goodput")
    ax.plot(rates, rates, ":", color="grey", label="offered")
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel(f"goodput (requests/s within TTFT {objective_ms:g} ms)")
    share = ax.twinx()
    share.plot(
        rates,
        [p["bubbletea_vllm"]["bubble_token_share"] for p in points],
        "^--",
        color="tab:green",
        label="prompt tokens computed in bubbles",
    )
    share.set_ylim(0, 1.05)
    share.set_ylabel("share of prompt tokens in bubbles")
    lines = ax.get_legend_handles_labels()
    more = share.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(res: dict[str, Any]) -> str:
    rows = [
        f"{'load':>6} {'arm':<15} {'ttft p50':>9} {'ttft p99':>9} {'SLO':>6} {'goodput':>8} {'bubbles':>8} "
        f"{'busy':>5} {'vllm s':>7} {'bt s':>6} failed"
    ]
    for p in res["points"]:
        for name in ("vllm_alone", "bubbletea_vllm"):
            a = p[name]
            rows.append(
                f"{p['rate_rps']:>6g} {name:<15} {a['ttft_p50_ms']!s:>9} {a['ttft_p99_ms']!s:>9} "
                f"{a['slo_attainment']!s:>6} {a['goodput_rps']!s:>8} {a.get('bubble_token_share', '')!s:>8} "
                f"{a.get('machine_busy_share')!s:>5} {a.get('vllm_cpu_s')!s:>7} "
                f"{a.get('bubbletea_cpu_s')!s:>6} "
                f"{json.dumps(a['failed'])}"
            )
    rows.append(
        f"TTFT objective {res['ttft_objective_ms']:g} ms, TPOT objective {res['tpot_objective_ms']:g} ms, "
        f"k = {res['time_scale']}; targets: {json.dumps(res['targets'])}"
    )
    return "\n".join(rows)


def result(points: list[dict[str, Any]], k: float | None, args: Any) -> dict[str, Any]:
    """The JSON line: the sweep's points, the targets' verdicts, and the picture's path."""
    res: dict[str, Any] = {
        "bench": "pd_vllm_sweep",
        "clock": "host wall",
        "time_scale": k,
        "ttft_objective_ms": args.ttft_objective_ms,
        "tpot_objective_ms": args.tpot_objective_ms,
        "duration_s": args.duration,
        "prompt_tokens_range": [args.prompt_min, args.prompt_max],
        "max_tokens": args.max_tokens,
        "placement": "auto",
        "vllm_nice": args.vllm_nice,
        "points": points,
        "targets": verdicts(points, args.ttft_objective_ms),
    }
    if args.picture and points:
        res["picture"] = str(picture(points, Path(args.picture), args.ttft_objective_ms))
    return res


def add_arguments(ap: Any) -> None:
    default_rates = ",".join(f"{r:g}" for r in SWEEP_RATES)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="offered loads from light to past the bubbles' capacity (--sweep-rates), each arm once per load, "
        "at time scale 1: goodput and the bubbles' share of the prompt tokens",
    )
    ap.add_argument(
        "--sweep-rates",
        type=_rates,
        default=SWEEP_RATES,
        metavar="R,R,...",
        help=f"the sweep's loads in requests/s; default {default_rates}",
    )
    ap.add_argument(
        "--ttft-objective-ms",
        type=float,
        default=500.0,
        metavar="MS",
        help="the TTFT objective: the front door's (bubbletea up --ttft-objective-ms) and the SLO's; default 500",
    )
    ap.add_argument(
        "--tpot-objective-ms",
        type=float,
        default=100.0,
        metavar="MS",
        help="the time-per-output-token objective goodput also asks; default 100",
    )
    ap.add_argument("--picture", metavar="PNG", help="with --sweep: draw goodput and the bubbles' share against load")
    ap.add_argument(
        "--vllm-nice",
        type=int,
        default=0,
        metavar="N",
        help="vLLM's scheduling niceness; default 0. `up` runs its front door at 10, yielding the shared "
        "cores to training; 10 gives vLLM the same place in both arms",
    )


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(x) for x in text.split(",") if x.strip())
    if not rates or min(rates) <= 0:
        raise ValueError(text)
    return rates
