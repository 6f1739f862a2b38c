"""`bubbletea up`: the whole system as local processes: a training run that serves prefill.

Starts Redis (embedded unless REDIS_URL is set), then every service of the table in
`bubbletea.launcher.services` (the same table `compose.yaml` is checked against): the WAN broker,
the dispatcher, the prefill front door and one stage worker per pipeline slot. Waits until each
is healthy (HTTP /health for the front door, heartbeats for the rest) and serving is ready (the
front door's /ready: training runs and a dispatcher fills its bubbles), prints the API URL, every
service's /metrics and where the logs go, writes ``<run folder>/prometheus-targets.json`` (the
endpoints for a Prometheus ``file_sd_configs``), and then follows the run:

* training goes on until Ctrl-C (the CLI sets ``training.iterations: until_stopped`` unless
  ``--iterations N`` is given; then everything stops when training finishes, every worker exit 0);
* each process's lines are prefixed with its name (warnings and errors only, unless --verbose;
  every line goes to ``<run folder>/logs/<name>.log``);
* Ctrl-C stops everything cleanly;
* it supervises (`bubbletea.launcher.supervise`): a stateless service that dies (the front door,
  the dispatcher, the WAN broker, the decoder) is restarted with the same environment (the front
  door on the same port) after a backoff (`shared.policies.restarts`), and waited on until healthy;
  a crash loop (more than 5 deaths in 60 s) stops everything, naming it and showing its last lines.
  A stage worker that dies still stops everything: training cannot survive a lost worker yet;
* a process that dies while everything starts stops everything, naming it and showing its last lines;
* on the way out the run folder gets the run's spans and summary, and the report pictures
  (`bubbletea report` can redraw them).

Over 300 lines on purpose: one command's start-up and shutdown, in the order they run; the health
and readiness waits live in readiness.py, supervision in supervise.py and the Redis watch in
redis_watch.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import socket
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec
import yaml

from bubbletea.launcher.procs import Proc, open_redis, spawn, stop_all
from bubbletea.launcher.readiness import metrics_endpoints, wait_healthy, wait_ready, wait_restarted, write_targets
from bubbletea.launcher.redis_watch import keep_redis_alive
from bubbletea.launcher.services import DISPATCHER, SERVICES, ServiceDef, instances
from bubbletea.launcher.supervise import Supervisor
from bubbletea.launcher.timescale import pick_time_scale
from bubbletea.launcher.vllm import managed_vllm
from bubbletea.launcher.wan_modes import WorkerLaunch, worker_launches
from shared.bus import Bus
from shared.bus.connection import TRANSIENT_ERRORS
from shared.config.deprecated import spec_builtins
from shared.config.settings import Settings
from shared.config.spec import ClusterSpec
from shared.control.leases import read_slots, release_dead, release_dispatcher_if_held_by
from shared.figures import runstats
from shared.policies.prompt_placement import Mode, mode_of
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis, free_port
from shared.wire.status import LeaseState


def say(text: str = "") -> None:
    print(text, flush=True)


async def run_up(
    settings: Settings,
    *,
    out_root: Path,
    verbose: bool = False,
    persist: bool = False,
    vllm_python: Path | None = None,
    redis_cluster: bool = False,
) -> int:
    """Run until Ctrl-C, SIGTERM (as a service manager or `kill` stops it: the same clean stop,
    exit 0), a dead service, or the end of a finite run."""
    task = asyncio.current_task()
    assert task is not None
    terminated = asyncio.Event()

    def on_sigterm() -> None:
        say("==> SIGTERM: stopping")
        terminated.set()
        task.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await _run_up(
            settings,
            out_root=out_root,
            verbose=verbose,
            persist=persist,
            vllm_python=vllm_python,
            redis_cluster=redis_cluster,
        )
    except asyncio.CancelledError:
        if not terminated.is_set():
            raise  # Ctrl-C: asyncio turns it into KeyboardInterrupt
        return 0
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def _run_up(
    settings: Settings, *, out_root: Path, verbose: bool, persist: bool, vllm_python: Path | None, redis_cluster: bool
) -> int:
    spec = settings.base_spec or settings.spec  # unscaled: the services apply the time scale
    run = settings.run if settings.run != "run" else f"up-{int(time.time())}"
    settings = dataclasses.replace(settings, run=run)
    folder = out_root / run
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # The services read the spec from a file: the one in effect (with any --iterations) goes there.
    spec_file = folder / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec_builtins(spec), sort_keys=False))
    embedded: EmbeddedRedis | EmbeddedCluster | None = None
    procs: list[Proc] = []
    started = time.time()
    wan = contextlib.AsyncExitStack()  # kernel mode: the namespaces the workers run in; a vLLM up started
    try:
        url, embedded, where = open_redis(
            settings.redis_url, persist_dir=folder / "redis" if persist else None, cluster=redis_cluster
        )
        say(f"==> {where}")
        if vllm_python is not None:  # --decode vllm without --vllm-url: ours, stopped after the services
            vllm_url = await wan.enter_async_context(managed_vllm(spec, vllm_python, logs / "vllm.log", say))
            spec = msgspec.structs.replace(spec, decode=msgspec.structs.replace(spec.decode, vllm_url=vllm_url))
            spec_file.write_text(yaml.safe_dump(spec_builtins(spec), sort_keys=False))
        scale = await pick_time_scale(settings, say)
        launches = await wan.enter_async_context(worker_launches(settings, url))
        port = spec.http.port or free_port()  # 0 in the spec: any free port, chosen here to print it
        up = _Services(settings, spec, url, port, folder, verbose, procs)
        await up.start_all(launches)
        await wait_healthy(procs, url, settings, up.api, say)
        state = await wait_ready(procs, up.api, say)
        endpoints = await metrics_endpoints(url, settings, up.api)
        write_targets(folder / "prometheus-targets.json", endpoints)
        _say_up(settings, spec, state, up.api, endpoints, folder, verbose)
        try:
            supervisor = Supervisor(
                procs,
                respawn=up.respawn,
                healthy=up.healthy,
                say=say,
                restart_workers=spec.training.recovers,
                departed=up.departed,
                buried=up.buried,
            )
            if not isinstance(embedded, EmbeddedRedis):  # a cluster's nodes fail over instead
                return await supervisor.follow()
            return await _first(supervisor.follow(), keep_redis_alive(embedded, say))
        finally:  # also on Ctrl-C: what ran so far is worth a report
            await _write_run_folder(url, settings, folder, started, scale)
    finally:
        codes = await stop_all(procs)
        bad = {n: c for n, c in codes.items() if c not in (0, None)}
        await wan.aclose()
        if embedded is not None:
            embedded.stop()
        say("==> stopped cleanly" if not bad else f"==> stopped; exit codes: {bad}")


class _Services:
    """The run's service processes in `procs` (the list `_run_up` stops and the supervisor
    follows): how each is started, started again after a death, and its leases buried."""

    def __init__(
        self, settings: Settings, spec: ClusterSpec, url: str, port: int, folder: Path, verbose: bool, procs: list[Proc]
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.url = url
        self.folder = folder
        self.verbose = verbose
        self.procs = procs
        self.api = f"http://{spec.http.host}:{port}"
        self.launch_of: dict[str, WorkerLaunch] = {}
        self.env = {
            "REDIS_URL": url,
            "BUBBLETEA_CONFIG": str(folder / "spec.yaml"),
            "BUBBLETEA_RUN": settings.run,
            "BUBBLETEA_LOG_LEVEL": settings.log_level,
            "BUBBLETEA_HTTP_HOST": spec.http.host,
            "BUBBLETEA_HTTP_PORT": str(port),
            "BUBBLETEA_METRICS_PORT": "0",  # each picks a free port and advertises it in its heartbeat
            "BUBBLETEA_STATE_DIR": str((folder / "state").absolute()),  # the workers' checkpoints
        }

    async def start_all(self, launches: list[WorkerLaunch]) -> None:
        """Every service of the table, one stage worker per slot, in the table's order."""
        spec = self.spec
        for svc in SERVICES:
            if svc.decode_only and not (spec.decode.enabled and spec.decode.engine == "builtin"):
                continue
            for label, launch in instances(svc, spec, launches):
                self.launch_of[label] = launch
                self.procs.append(await self._start(svc, label))

    async def _start(self, svc: ServiceDef, label: str) -> Proc:
        launch = self.launch_of.get(label, WorkerLaunch())
        p = await spawn(
            svc,
            {**self.env, **launch.env},
            quiet=not self.verbose,
            log_file=self.folder / "logs" / f"{label}.log",
            label=label,
            prefix=launch.prefix,
        )
        say(f"==> started {label} (pid {p.proc.pid})")
        return p

    async def respawn(self, dead: Proc) -> Proc:
        """The same service, environment (the front door: its port) and label; the same log."""
        return await self._start(dead.svc, dead.label)

    async def healthy(self, p: Proc) -> None:
        await wait_restarted(p, self.url, self.settings, self.api)
        if p.proc.returncode is None:  # its /metrics moved (a free port): Prometheus follows the file
            pids = {q.proc.pid for q in self.procs}
            endpoints = await metrics_endpoints(self.url, self.settings, self.api, pids)
            write_targets(self.folder / "prometheus-targets.json", endpoints)

    async def departed(self) -> bool:
        """A slot some worker left on purpose, not yet taken again."""
        pp, dp = self.spec.parallelism.pp, self.spec.parallelism.dp
        async with Bus(self.url, self.spec.bus, name="up") as bus:
            views = await read_slots(bus.redis, self.settings.run, pp, dp)
        return any(v.ended is LeaseState.LEFT and not v.held for v in views)

    async def buried(self, dead: Proc) -> None:
        """A dead worker's or dispatcher's lease: released now."""
        if not dead.svc.per_slot and dead.svc is not DISPATCHER:
            return
        run, pp, dp = self.settings.run, self.spec.parallelism.pp, self.spec.parallelism.dp
        holder = f"{socket.gethostname()}-{dead.proc.pid}"  # as it named itself (instance_id)
        try:
            async with Bus(self.url, self.spec.bus, name="up") as bus:
                if dead.svc is DISPATCHER:
                    dc = self.launch_of.get(dead.label, WorkerLaunch()).env.get("BUBBLETEA_DC")
                    await release_dispatcher_if_held_by(bus.redis, run, f"{DISPATCHER.name}-{holder}", dc)
                else:
                    await release_dead(bus.redis, run, pp, dp, holder)
        except TRANSIENT_ERRORS:  # Redis away: the lease expires by itself, as before
            pass


def _say_up(
    settings: Settings,
    spec: ClusterSpec,
    state: str,
    api: str,
    endpoints: list[tuple[str, str]],
    folder: Path,
    verbose: bool,
) -> None:
    """What is up, where to send a prompt, where the metrics and logs are, and what Ctrl-C does."""
    slots = spec.parallelism.pp * spec.parallelism.dp
    until = "until Ctrl-C" if spec.training.until_stopped else f"for {spec.training.iterations} iterations"
    say("")
    say(
        f"==> BubbleTea is up: run {settings.run}, PP={spec.parallelism.pp} x DP={spec.parallelism.dp}, {slots} workers"
    )
    say(f"    serving: {state}; training {until}")
    say(f"    API:  {api}   (OpenAI-compatible: POST {api}/v1/completions; docs/api.md)")
    body = '{"prompt": "Hello"}'
    auth = ' -H "Authorization: Bearer $BUBBLETEA_API_KEY"' if settings.api_key else ""
    say(f"    try:  curl -s {api}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    key = "?key=$BUBBLETEA_API_KEY" if settings.api_key else ""
    say(f"    page: {api}/dashboard{key}   (the run live: bubbles, figures, faults; docs/running.md)")
    if spec.decode.enabled:
        who = f"vLLM at {spec.decode.vllm_url} (docs/vllm.md)" if spec.decode.engine == "vllm" else "the decoder"
        say(f"    whole completions (max_tokens > 1): prefilled in the bubbles, decoded by {who}")
        mode = mode_of(spec.prefill.placement, spec.decode.enabled)
        objective = spec.prefill.ttft_objective_ms
        if mode is Mode.AUTO and objective is not None:
            say(f"    a prompt the bubbles cannot compute within {objective:g} ms: computed by {who} (auto)")
        elif mode is Mode.DECODER:
            say(f"    every prompt computed by {who} (placement decoder)")
    say(f"    metrics: {len(endpoints)} endpoints, in {folder / 'prometheus-targets.json'} (Prometheus file_sd)")
    for label, metrics_url in endpoints:
        say(f"      {label:<18} {metrics_url}")
    logs = folder / "logs"
    say(f"    logs: {logs}/<service>.log (warnings and errors also here{'' if verbose else '; -v for all'})")
    stateless = "a dead front door, dispatcher, WAN broker or decoder"
    restarted = "every service" if spec.training.recovers else stateless
    say(f"    Ctrl-C stops everything; {restarted} is restarted if it dies")
    say("")


async def _first(main: Coroutine[Any, Any, int], guard: Coroutine[Any, Any, None]) -> int:
    """`main`'s result, unless `guard` (which runs until cancelled) fails first: its error then."""
    first, second = asyncio.ensure_future(main), asyncio.ensure_future(guard)
    try:
        done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
        if second in done:
            second.result()  # raises: a guard ends only by failing
        return await first
    finally:
        for t in (first, second):
            t.cancel()
        await asyncio.gather(first, second, return_exceptions=True)


async def _write_run_folder(url: str, settings: Settings, folder: Path, started: float, scale: float) -> None:
    """The run's spans and a one-row summary (with its device time scale), then the report pictures."""
    async with Bus(url, settings.spec.bus, name="up") as bus:
        spans = await runstats.run_spans(bus.redis, settings.run)
    (folder / "run").mkdir(exist_ok=True)
    runstats.write_spans(folder / "run" / "spans.jsonl", spans)
    u = runstats.utilization(spans)
    summary = {
        "spec": str(settings.spec_path),
        "device_time_scale": scale,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "runs": [
            {
                "name": "run",
                "label": f"{settings.run} ({'BubbleTea on' if settings.spec.bubbletea.enabled else 'BubbleTea off'})",
                "metrics": {
                    "bubble_fraction": round(u.bubble, 4),
                    "utilization": round(u.busy, 4),
                    "bubble_fill_ratio": round(u.fill_ratio, 3),
                },
            }
        ],
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    from bubbletea.report import write_report

    written = write_report(folder)
    say(f"==> run folder: {folder} (report.md and {len(written) - 1} more files)")
