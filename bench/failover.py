"""Failover that loses nothing (issue 66, item 4): the Redis master holding the run's slot SIGKILLed
under load, again and again; is any accepted request lost or answered twice, does training go on?

Starts an embedded Redis Cluster (3 masters, 1 replica each: shared/runtime/redis_cluster.py) of its
own, as `bubbletea up --redis-cluster` does, and runs `bubbletea up` on it (`REDIS_URL` names the
cluster: every service, training until stopped, at the measured time scale `k`), under the chaos
bench's native-request client (`POST /v1/prefill`, each request with its own Idempotency-Key,
retried with the same key while a call fails) at `--load` (0.8) of what the bubbles answer
(`churn.capacity_rate`). Every key of the run carries its hash tag: one master holds them all. Each
of `--kills` rounds SIGKILLs that master (by its PID), waits for its replica to be promoted, then
starts the dead node again on its port and files: it rejoins as the new master's replica
(`EmbeddedCluster.revive`), so the next kill has a replica to promote. Then every accepted
request's final status is read from its record.

Figures (one JSON line last; clock: the host's wall clock, seconds):

* `accepted`, `answered`, `failed` (by reason), `refused` (not accepted, by HTTP status: a 503
  while the slot has no master, for instance), `client_retries`;
* `lost`: accepted, never answered nor failed (must be 0);
* `answered_twice`: a request whose record's answer differs from one its front door was sent, or
  sent two different answers (its results streams: must be 0); `answers_repeated`: one sent twice
  the same (a redelivery the first-answer-wins script turned into a no-op is not written twice, so
  this counts a re-answer after a failover);
* `duplicated`: client requests given two ids across retries (must be 0);
* `back_after_s`: per kill, from the SIGKILL to the answer (its `finished`) of the first request
  accepted after it; p50 / p99 / max, a kill after which no request accepted was answered counted
  as infinite ("inf"); `failover_s`: per kill, to the replica's promotion as the nodes report it;
* training: `iterations_trained_twice`, `generations`, `losses_equal` (chaos.py's check against
  single-process training), `joined_from` (the sources the workers resumed from, in their logs:
  `peers` after a recovery, `checkpoint` would be a step back), `restarts` (services `up` restarted:
  any is a service that exited), `up_exit_code`;
* `accept_cost`: an accept's latency (one after another, on the cluster before the run starts)
  with the replica's acknowledgement and without it, p50 and mean, ms;
* `met`: lost 0, answered twice 0, duplicated 0, trained twice 0, no checkpoint resume after the
  start, no service restarted, every `back_after_s` < `BACK_TARGET_S`.

    python bench/failover.py              # 5 kills, 20 s apart
    python bench/failover.py --quick      # 2 kills, 12 s apart
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chaos  # noqa: E402
import churn  # noqa: E402

from shared.bus.connection import client_for, command_client  # noqa: E402
from shared.config.spec import load_spec  # noqa: E402
from shared.control import serving  # noqa: E402
from shared.figures.percentiles import percentile  # noqa: E402
from shared.runtime.redis_cluster import EmbeddedCluster  # noqa: E402
from shared.runtime.redis_server import free_port  # noqa: E402
from shared.wire import PrefillRequest, PrefillResult, decode, encode, keys  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "demo.yaml"
#: The issue's target: serving back within this after a master is killed.
BACK_TARGET_S = 5.0
#: How long the bench waits for the killed master's replica to be promoted before it calls the
#: kill unrecovered (the node timeout is 3 s; an election follows within about a second).
PROMOTION_TIMEOUT_S = 60.0
#: Accepts timed with and without the replica's acknowledgement (`wait_cost`).
COST_ACCEPTS = 300
JOINED = re.compile(r'msg="?joined the run"?.*source=(\w+)')


class Load(chaos.Load):
    """chaos.py's client, and when each request was accepted (host wall clock)."""

    def __init__(self, api: str, rate: float, seed: int = 0) -> None:
        super().__init__(api, rate, seed)
        self.accepted_at: dict[str, float] = {}

    async def _one(self, http: aiohttp.ClientSession) -> None:
        key = uuid.uuid4().hex
        prompt = [self.rng.randrange(256) for _ in range(self.rng.randint(8, 128))]
        body = {"prompt": prompt, "deadline_ms": chaos.DEADLINE_MS}
        give_up = time.monotonic() + chaos.RETRY_FOR_S
        while True:
            try:
                async with http.post(f"{self.api}/v1/prefill", json=body, headers={"Idempotency-Key": key}) as resp:
                    if resp.status in (200, 202):  # 200: a retry found its key already used
                        rid = (await resp.json())["id"]
                        if self.ids.setdefault(key, rid) != rid:
                            self.duplicated += 1
                        self.accepted_at.setdefault(rid, time.time())
                        return
                    if resp.status != 503 or time.monotonic() > give_up:
                        self.refused[resp.status] += 1
                        return
            except (aiohttp.ClientError, TimeoutError):
                if time.monotonic() > give_up:
                    self.refused[0] += 1
                    return
            self.retries += 1  # the front door is down, or its Redis slot has no master yet: same key
            await asyncio.sleep(0.5)


async def records(url: str, run: str, ids: list[str], timeout_s: float) -> dict[str, PrefillResult | str]:
    """Each request's record once it is answered or failed (or its status when `timeout_s` ran
    out: "queued", or "unknown" for no record), read from Redis, not through `GET /v1/prefill/{id}`,
    which shortens a record's life to `keys.PREFILL_READ_GRACE_S` once read."""
    r = client_for(url, socket_timeout=10)
    out: dict[str, PrefillResult | str] = {}
    deadline = time.monotonic() + timeout_s
    todo = list(ids)
    try:
        while todo:
            for rid in todo:
                found = await serving.lookup(r, run, rid)
                out[rid] = "unknown" if found is None else found.result or str(found.status)
            todo = [rid for rid in todo if not isinstance(out[rid], PrefillResult)]
            if not todo or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)  # a poll of stored records: there is no push to wait on
    finally:
        await r.aclose()
    return out


async def sent_answers(url: str, run: str) -> dict[str, list[bytes]]:
    """Every answer written to the run's front doors' results streams, by request id."""
    r = client_for(url, socket_timeout=10)
    out: dict[str, list[bytes]] = {}
    try:
        await r.initialize()  # the slot map, before a node is named
        node = r.get_node_from_key(keys.prefill_requests_stream(run))  # type: ignore[attr-defined]
        pattern = keys.prefill_results_stream(run, "*")
        async for name in r.scan_iter(match=pattern, count=1000, target_nodes=node):
            entries: Any = await r.xrange(name)
            for _, fields in entries:
                msg = decode(fields[b"m"])
                if isinstance(msg, PrefillResult):
                    out.setdefault(msg.id, []).append(fields[b"m"])
    finally:
        await r.aclose()
    return out


def twice(final: dict[str, PrefillResult | str], sent: dict[str, list[bytes]]) -> tuple[int, int]:
    """(answered twice: two different answers, or a record that differs from what was sent;
    answers repeated: the same answer sent twice)."""
    different = repeated = 0
    for rid, got in sent.items():
        kept = final.get(rid)
        record = {encode(kept)} if isinstance(kept, PrefillResult) else set()
        if len(set(got)) > 1 or (record and set(got) - record):
            different += 1
        elif len(got) > 1:
            repeated += 1
    return different, repeated


def back_after(kills: list[dict[str, Any]], accepted_at: dict[str, float], final: dict[str, Any]) -> list[float]:
    """Per kill: SIGKILL to the answer of the first request accepted after it (inf: none answered)."""
    out = []
    for k in kills:
        after = sorted((t, rid) for rid, t in accepted_at.items() if t > k["at"])
        answered = [final[rid] for _, rid in after if isinstance(final.get(rid), PrefillResult)]
        first = answered[0] if answered else None
        out.append(round(first.finished - k["at"], 2) if first is not None else float("inf"))
    return out


def joined_from(folder: Path) -> list[str]:
    """The source of every "joined the run" in the services' logs, in file order."""
    found = []
    for log in sorted(folder.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if m := JOINED.search(line):
                found.append(m.group(1))
    return found


async def wait_cost(url: str, n: int = COST_ACCEPTS) -> dict[str, float]:
    """What the replica's acknowledgement costs an accept: `n` accepts one after another on the
    cluster with it (`serving.accept`) and without (the same script alone), p50 and mean in ms."""
    r = command_client(url)
    run = f"cost-{uuid.uuid4().hex[:6]}"
    timings: dict[str, list[float]] = {"with_wait": [], "without": []}
    try:
        for i in range(n):
            for arm in ("with_wait", "without"):
                req = cost_request(run, f"{arm}-{i}")
                t = time.perf_counter()
                if arm == "with_wait":
                    await serving.accept(r, run, req, 10 * n)
                else:
                    await r.eval(*serving.accept_args(run, req, 10 * n))
                timings[arm].append((time.perf_counter() - t) * 1000)
    finally:
        await r.aclose()
    out = {f"{arm}_p50_ms": round(percentile(v, 50) or 0.0, 3) for arm, v in timings.items()}
    out |= {f"{arm}_mean_ms": round(sum(v) / len(v), 3) for arm, v in timings.items()}
    return out


def cost_request(run: str, rid: str) -> PrefillRequest:
    now = time.time()
    reply_to = keys.prefill_results_stream(run, "cost")
    return PrefillRequest(id=rid, model="m", tokens=(1, 2, 3), submitted=now, deadline=now + 60, reply_to=reply_to)


async def kill_rounds(cluster: EmbeddedCluster, run: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--kills` times: SIGKILL the run's master, wait for its promoted replica, revive the dead node."""
    stream = keys.prefill_requests_stream(run)
    kills = []
    for i in range(args.kills):
        await asyncio.sleep(args.gap)
        old = await asyncio.to_thread(cluster.master_of, stream)
        at = time.time()
        await asyncio.to_thread(cluster.kill, old.port)  # SIGKILL by its PID
        promoted = None
        while promoted is None and time.time() - at < PROMOTION_TIMEOUT_S:
            await asyncio.sleep(0.1)  # the nodes' own view: there is no event to wait on
            try:
                node = await asyncio.to_thread(cluster.master_of, stream)
            except Exception:  # no live master serves the slot yet
                continue
            promoted = node if node.port != old.port else None
        record = {"kill": i, "port": old.port, "pid": old.pid, "at": at}
        record["failover_s"] = round(time.time() - at, 2) if promoted else float("inf")
        await asyncio.to_thread(cluster.revive, old.port)  # back as the new master's replica
        kills.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "at"}), file=sys.stderr, flush=True)
    return kills


async def failover(args: argparse.Namespace) -> dict[str, Any]:
    k = await asyncio.to_thread(churn.time_scale, args.time_scale, args.config)
    rate = args.load * await asyncio.to_thread(churn.capacity_rate, args.config, k)
    out = Path(tempfile.mkdtemp(prefix="bubbletea-failover-"))
    print(f"failover: k = {k:g}, {rate:.2f} requests/s ({args.load:.0%} of capacity); {out}", file=sys.stderr)
    cluster = await asyncio.to_thread(EmbeddedCluster().start)
    cost = await wait_cost(cluster.url)  # on the quiet cluster, before the run starts
    port, run = free_port(), f"failover-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "REDIS_URL": cluster.url, "BUBBLETEA_HTTP_PORT": str(port), "BUBBLETEA_RUN": run}
    env |= {"BUBBLETEA_TIME_SCALE": f"{k:g}", "BUBBLETEA_DECAY_ITERS": str(chaos.DECAY_ITERS)}
    env.pop("BUBBLETEA_API_KEY", None)
    cmd = (sys.executable, "-m", "bubbletea.cli", "up", "--config", str(args.config), "--out", str(out))
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    up = chaos.Up(proc)
    api = f"http://127.0.0.1:{port}"
    load = Load(api, rate, seed=args.seed)
    t0 = time.monotonic()
    try:
        await up.wait_for(r"Ctrl-C stops everything", churn.UP_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            loader = asyncio.create_task(load.run(http))
            kills = await kill_rounds(cluster, run, args)
            await asyncio.sleep(args.gap)
            load.stop.set()
            await loader
        print(f"failover: load over, {len(load.ids)} accepted; reading their records", file=sys.stderr, flush=True)
        ids = sorted(load.ids.values())
        final = await records(cluster.url, run, ids, chaos.DEADLINE_MS / 1000 + 60)
        sent = await sent_answers(cluster.url, run)
        await chaos.stop_up(proc)
        trained = load_spec(out / run / "spec.yaml")
        done = await asyncio.to_thread(chaos.iterations_done, cluster.url, run)
        training = await asyncio.to_thread(chaos.training_figures, done, trained)
    finally:
        if proc.returncode is None:
            await chaos.stop_up(proc)
        await asyncio.gather(up.reader, return_exceptions=True)
        await asyncio.to_thread(cluster.stop)
        (out / "up.out").write_text("\n".join(up.lines) + "\n")
        print(f"bubbletea up's output and the run folder: {out}", file=sys.stderr, flush=True)
    return figures(args, k, rate, load, kills, final, sent, training, up, proc.returncode, out, t0) | {
        "accept_cost": cost
    }


def figures(
    args: argparse.Namespace,
    k: float,
    rate: float,
    load: Load,
    kills: list[dict[str, Any]],
    final: dict[str, PrefillResult | str],
    sent: dict[str, list[bytes]],
    training: dict[str, Any],
    up: chaos.Up,
    exit_code: int | None,
    out: Path,
    t0: float,
) -> dict[str, Any]:
    statuses = Counter(v.status.value if isinstance(v, PrefillResult) else v for v in final.values())
    unfinished = sorted(rid for rid, v in final.items() if not isinstance(v, PrefillResult))
    failed = Counter(str(v.reason) for v in final.values() if isinstance(v, PrefillResult) and v.status == "failed")
    lost = sum(n for st, n in statuses.items() if st not in ("done", "failed"))
    different, repeated = twice(final, sent)
    back = back_after(kills, load.accepted_at, final)
    restarts = Counter(m.group(1) for line in up.lines if (m := re.search(r"==> (\S+) restarted \(pid", line)))
    sources = joined_from(out)
    # the first join of each worker is the run's start (from scratch); any checkpoint after is a step back
    from_checkpoint = sources.count("checkpoint")
    met = (
        lost == 0
        and different == 0
        and load.duplicated == 0
        and training["iterations_trained_twice"] == 0
        and from_checkpoint == 0
        and not restarts
        and all(b < BACK_TARGET_S for b in back)
    )
    return {
        "bench": "failover",
        "clock": "host wall",
        "time_scale_k": k,
        "rate_rps": round(rate, 3),
        "load": args.load,
        "kills": len(kills),
        "revived_as_replica": True,
        "accepted": len(final),
        "answered": statuses.get("done", 0),
        "failed": dict(failed),
        "refused": {str(s): n for s, n in load.refused.items()},
        "client_retries": load.retries,
        "lost": lost,
        "unfinished_by_status": {st: n for st, n in statuses.items() if st not in ("done", "failed")},
        "unfinished_ids": unfinished[:10],
        "answered_twice": different,
        "answers_repeated": repeated,
        "duplicated": load.duplicated,
        "failover_s": [kl["failover_s"] for kl in kills],
        "back_after_s": back,
        "back_p50_s": percentile(back, 50) if back else None,
        "back_p99_s": percentile(back, 99) if back else None,
        "back_max_s": max(back, default=None),
        "back_target_s": BACK_TARGET_S,
        "iterations_trained_twice": training["iterations_trained_twice"],
        "generations": training["generations"],
        "losses_equal": training["losses_equal"],
        "joined_from": dict(Counter(sources)),
        "restarts": dict(restarts),
        "up_exit_code": exit_code,
        "met": met,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=5, help="times the run's master is SIGKILLed (default 5)")
    p.add_argument("--gap", type=float, default=20.0, help="seconds of load before each kill (default 20)")
    p.add_argument("--load", type=float, default=0.8, help="offered load, a share of the bubbles' capacity")
    p.add_argument("--time-scale", default="auto", help="k, or auto: measured (bench/churn.py)")
    p.add_argument("--seed", type=int, default=0, help="the load's seed")
    p.add_argument("--quick", action="store_true", help="2 kills, 12 s apart")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the spec `up` runs")
    args = p.parse_args(argv)
    if args.kills < 1 or args.gap <= 0 or not 0 < args.load <= 2:
        p.error("--kills must be >= 1, --gap > 0 and --load in (0, 2]")
    if args.quick:
        args.kills, args.gap = 2, 12.0
    random.seed(args.seed)
    result = asyncio.run(failover(args))
    print(json.dumps(result))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
