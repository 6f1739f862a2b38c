"""The figures of `bench/faults.py` from what a run left: its Redis (answers, batches, iteration
reports) and its workers' logs (when each joined a generation); and each arm's verdict."""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench import chaos
from bench.lib import churn_figures as figs
from bench.lib.fault_arms import SERVING_TARGET_S
from shared.bus.connection import sync_client_for
from shared.figures.percentiles import percentile
from shared.wire import FIELD, PrefillBatch, decode, keys


def duplicates(url: str, run: str, spec: Any) -> dict[str, int]:
    """Requests answered twice (one id twice in the front doors' result streams) and scheduled twice
    (one id in two different batches of the fill streams)."""

    r = sync_client_for(url, protocol=None, socket_timeout=30)
    try:
        answered: Counter[str] = Counter()
        for stream in r.scan_iter(keys.prefill_results_stream(run, "*")):
            answered.update(decode(f[FIELD]).id for _, f in r.xrange(stream))
        batches: dict[str, set[str]] = {}
        for d in range(spec.parallelism.dp):
            for k in range(spec.parallelism.pp):
                for _, f in r.xrange(keys.fill_stream(run, d, k)):
                    if isinstance(b := decode(f[FIELD]), PrefillBatch):
                        for item in b.items:
                            batches.setdefault(item.id, set()).add(b.batch_id)
    finally:
        r.close()
    return {
        "answered_twice": sum(c > 1 for c in answered.values()),
        "scheduled_twice": sum(len(v) > 1 for v in batches.values()),
    }


def losses_of(url: str, run: str) -> dict[tuple[int, int], list[float]]:
    """Every loss reported: (iteration, replica) -> the losses, in the order reported."""
    out: dict[tuple[int, int], list[float]] = {}
    for m in chaos.iterations_done(url, run):
        if m.loss is not None:
            out.setdefault((m.iteration, m.replica), []).append(m.loss)
    return out


def exact(
    losses: dict[tuple[int, int], list[float]], calm: dict[tuple[int, int], list[float]] | None
) -> dict[str, Any]:
    """Every loss reported against the calm run's for the same iteration and replica, bit for bit."""
    if calm is None:
        return {"losses_exact": None, "iterations_compared": 0}
    common = sorted(set(losses) & set(calm))
    unequal = [key for key in common if any(v != calm[key][0] for v in losses[key])]
    return {
        "losses_exact": bool(common) and not unequal,
        "iterations_compared": len({i for i, _ in common}),
        "first_unequal": list(unequal[0]) if unequal else None,
    }


def figures(
    live: Any, arm: Any, records: list[dict[str, Any]], load: dict[str, Any], start: float, end: float
) -> dict[str, Any]:
    spec = live.spec
    slots = spec.parallelism.pp * spec.parallelism.dp
    served = figs.serving(load, live.args.ttft_slo_ms * live.k)
    done = chaos.iterations_done(live.server.url, live.run)
    trained = chaos.training_figures(done, spec)
    out: dict[str, Any] = {
        "arm": live.arm,
        "expect": arm.expect if arm else "calm",
        "faults": len(records),
        "seconds": round(end - start, 1),
        "requests_sent": served["requests_sent"],
        "requests_answered": served["requests_answered"],
        "requests_lost": served["errors"].get("timeout", 0),
        "errors": served["errors"],
        "slo_attainment": served["slo_attainment"],
        **duplicates(live.server.url, live.run, spec),
        "iterations_trained_twice": trained["iterations_trained_twice"],
        "losses_equal_reference": trained["losses_equal"],
        "loss_max_abs_err_reference": trained["loss_max_abs_err"],
        "generations": trained["generations"],
        "_losses": losses_of(live.server.url, live.run),
        "records": records,
    }
    if arm is not None and arm.expect == "kept":
        out["kept"] = sum(bool(r.get("kept")) for r in records)
    if arm is not None and arm.name == "dispatcher-kill":
        out |= kill_figures(records)
    elif arm is not None:
        joined = live.joins()
        backs = [figs.recovered_in(figs.back_after(r["at"], r["generation"], joined, slots)) for r in records]
        out["recovered"] = sum(b != float("inf") for b in backs)
        for p in (50, 99):
            out[f"back_p{p}_s"] = figs.rounded(percentile(backs, p))
        out["back_max_s"] = figs.rounded(max(backs, default=None))
    return out


def kill_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A dispatcher kill's figures (`fault_arms.DispatcherKill`): kill to the lease taken over
    (`takeover_s`) and to the new leader's first batch (`serving_s`), p50 / p99 / max, every kill
    counted (one never taken over or served as infinite); how many the standby took over."""
    out: dict[str, Any] = {"taken_over": sum(r.get("takeover_s") is not None for r in records)}
    out["by_standby"] = sum(bool(r.get("by_standby")) for r in records)
    for figure in ("takeover_s", "serving_s"):
        values = [figs.recovered_in(r.get(figure)) for r in records]
        out[figure] = [figs.rounded(v) for v in values]
        for p in (50, 99):
            out[f"{figure[:-2]}_p{p}_s"] = figs.rounded(percentile(values, p))
        out[f"{figure[:-2]}_max_s"] = figs.rounded(max(values, default=None))
    return out


def verdict(res: dict[str, Any], faults: int) -> dict[str, Any]:
    """Whether an arm did all it must (`met`), and if not, why."""
    why = []
    if res["requests_lost"]:
        why.append(f"{res['requests_lost']} requests lost")
    if res["answered_twice"]:
        why.append(f"{res['answered_twice']} answered twice")
    if res["iterations_trained_twice"]:
        why.append(f"{res['iterations_trained_twice']} iterations trained twice")
    if res.get("losses_exact") is False:
        why.append(f"a loss differs from the calm run's at (iteration, replica) {res['first_unequal']}")
    if res["expect"] == "kept":
        if res["kept"] < faults:
            why.append(f"{faults - res['kept']} of {faults} faults moved a slot or recovered")
        if res["scheduled_twice"]:
            why.append(f"{res['scheduled_twice']} requests scheduled twice")
    elif res["expect"] == "recovered" and res["recovered"] < faults:
        why.append(f"{faults - res['recovered']} of {faults} faults never recovered")
    if res["arm"] == "dispatcher-stall" and (stayed := sum(not r.get("taken_over") for r in res["records"])):
        why.append(f"{stayed} stalls the standby dispatcher did not take over")
    if res["arm"] == "dispatcher-kill":
        slow = [v for v in res["serving_s"] if v == "inf" or v >= SERVING_TARGET_S]
        if slow:
            why.append(f"{len(slow)} of {faults} kills not served by a new leader within {SERVING_TARGET_S:g} s")
    if res["arm"] == "lost-host":
        limit = keys.LEASE_TTL_MS / 1000 + 2
        slow = [r for r in res["records"] if r.get("taken_s") is None or r["taken_s"] > limit]
        if slow:
            why.append(f"{len(slow)} lost hosts not taken over within {limit:g} s")
        if stayed := sum(r.get("exited_after_heal_s") is None for r in res["records"]):
            why.append(f"{stayed} lost hosts' workers still ran after the network healed")
    return {"met": not why, "why": why}
