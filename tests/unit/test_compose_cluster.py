"""compose.cluster.yaml, the overlay that runs compose.yaml's stack on a Redis Cluster. No Docker
engine runs here, so the two files are merged as compose merges them (mappings merged, sequences
appended, ``!override`` replacing) and the result is checked: six cluster-enabled nodes with the
single redis's settings and a volume each, a one-shot service forming them with a command the real
parser accepts, every BubbleTea service on the cluster's URL and waiting for it, no active service
depending on one that is off; and compose.yaml alone (the default) as it was: one redis.

compose.per-dc.yaml, on top of the two, runs a dispatcher per datacenter: one for each datacenter the
project's own `dispatch_dcs` gives for the spec the services mount, each naming its DC (as the
dispatcher's `served_dc` accepts it), every BubbleTea service in the same dispatch mode; the default
stack, with or without the cluster, keeps its one dispatcher."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from bubbletea.commands import build_parser
from services.dispatcher.serve import served_dc
from shared.config import env_values
from shared.config.settings import load_settings
from shared.policies.pipeline_plan import dispatch_dcs
from shared.runtime.cluster_form import Address

ROOT = Path(__file__).resolve().parents[2]
NODES = [f"redis-{i}" for i in range(1, 7)]


class _Override(dict):  # type: ignore[type-arg]
    """A mapping tagged ``!override``: it replaces, not merges, what compose.yaml has."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!override", lambda loader, node: _Override(loader.construct_mapping(node, deep=True)))


def _load(name: str) -> dict[str, Any]:
    return yaml.load((ROOT / name).read_text(encoding="utf-8"), Loader=_Loader)


def _merge(base: Any, over: Any) -> Any:
    """Compose's merge rules, for what these files use."""
    if isinstance(over, _Override):
        return dict(over)
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + over
    return over


def _active(services: dict[str, Any]) -> dict[str, Any]:
    """The services `docker compose up` starts with no profile named."""
    return {name: spec for name, spec in services.items() if not spec.get("profiles")}


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_default_stack_is_one_redis_as_before() -> None:
    base = _load("compose.yaml")
    active = _active(base["services"])
    assert "redis" in active and not set(NODES) & set(base["services"])
    assert "redis-cluster-form" not in base["services"]
    for name, spec in active.items():
        url = spec.get("environment", {}).get("REDIS_URL")
        assert url is None or url.endswith("}@redis:6379/0"), name


def test_the_overlay_runs_every_service_on_a_formed_cluster() -> None:
    base, overlay = _load("compose.yaml"), _load("compose.cluster.yaml")
    merged = _merge(base, overlay)
    services = merged["services"]
    active = _active(services)
    assert "redis" not in active  # the single Redis is off

    single = base["services"]["redis"]["command"]
    for node in NODES:
        spec = active[node]
        cmd = spec["command"]
        assert _option(cmd, "--cluster-enabled") == "yes"
        for option in ("--requirepass", "--maxmemory", "--maxmemory-policy", "--appendonly", "--appendfsync"):
            assert _option(cmd, option) == _option(single, option), (node, option)
        assert _option(cmd, "--masterauth") == _option(cmd, "--requirepass")  # a replica can sync
        assert spec["healthcheck"]["test"] == base["services"]["redis"]["healthcheck"]["test"]
        (volume,) = spec["volumes"]
        assert volume == f"{node}-data:/data" and f"{node}-data" in merged["volumes"]

    form = active["redis-cluster-form"]
    args = build_parser().parse_args(form["command"][1:])
    assert form["command"][0] == "bubbletea" and form["restart"] == "no"
    assert args.form_cluster == [Address(node, 6379) for node in NODES] and args.replicas == 1
    assert form["depends_on"] == {node: {"condition": "service_healthy"} for node in NODES}

    bubbletea = [n for n, s in base["services"].items() if "REDIS_URL" in s.get("environment", {})]
    assert {"prefill_queue", "wan_broker", "dispatcher", "stage_worker", "decoder", "loadgen"} <= set(bubbletea)
    for name in bubbletea:
        url = services[name]["environment"]["REDIS_URL"]
        assert url.startswith("redis+cluster://:${REDIS_PASSWORD:?") and url.endswith("}@redis-1:6379"), name
        filled = re.sub(r"\$\{[^}]*\}", "pw", url)  # as compose fills it in
        assert env_values.redis_url(filled) == filled == "redis+cluster://:pw@redis-1:6379"
        # the rest of its environment as in compose.yaml
        assert {k: v for k, v in services[name]["environment"].items() if k != "REDIS_URL"} == {
            k: v for k, v in base["services"][name]["environment"].items() if k != "REDIS_URL"
        }
    assert form["environment"]["REDIS_URL"] == services["dispatcher"]["environment"]["REDIS_URL"]

    for name, spec in active.items():  # nothing waits on a service that is off, or on the single redis
        deps = spec.get("depends_on", {})
        assert "redis" not in deps and set(deps) <= set(active), (name, deps)
        if name in bubbletea and name != "loadgen":
            assert deps["redis-cluster-form"] == {"condition": "service_completed_successfully"}, name
            # its other dependencies as in compose.yaml
            assert {d: c for d, c in deps.items() if d != "redis-cluster-form"} == {
                d: c for d, c in base["services"][name]["depends_on"].items() if d != "redis"
            }, name


# --- compose.per-dc.yaml: a dispatcher per datacenter, on the cluster ---------------------------

DISPATCHER_CMD = ["python", "-m", "services.dispatcher"]


def _defaulted(text: str) -> str:
    """A compose string as it runs with nothing set: each ${VAR:-default} its default, a required
    ${VAR:?...} (the password) "pw"."""
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "pw", re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text))


def _per_dc_stack() -> tuple[dict[str, Any], dict[str, Any]]:
    """(compose.yaml merged with compose.cluster.yaml, the same with compose.per-dc.yaml on top)."""
    cluster = _merge(_load("compose.yaml"), _load("compose.cluster.yaml"))
    return cluster, _merge(cluster, _load("compose.per-dc.yaml"))


def _spec_path(service: dict[str, Any]) -> Path:
    """The spec file a service mounts when BUBBLETEA_SPEC is unset."""
    (mount,) = [v for v in service["volumes"] if v.endswith(":/etc/bubbletea/spec.yaml:ro")]
    return ROOT / _defaulted(mount).split(":")[0]


def test_the_per_dc_overlay_runs_one_dispatcher_for_each_datacenter_that_holds_stages() -> None:
    cluster, merged = _per_dc_stack()
    active = _active(merged["services"])
    assert "dispatcher" not in active  # the run's one dispatcher is off
    dispatchers = {name: s for name, s in active.items() if s.get("command") == DISPATCHER_CMD}
    spec_path = _spec_path(cluster["services"]["dispatcher"])
    # the datacenters, as the dispatchers themselves compute them: the spec they mount, per_dc
    dcs = dispatch_dcs(load_settings(spec_path, env={"BUBBLETEA_DISPATCH": "per_dc"}).spec)
    assert dcs and None not in dcs
    assert sorted(dispatchers) == sorted(f"dispatcher-{dc}" for dc in dcs)
    one = cluster["services"]["dispatcher"]
    for name, spec in dispatchers.items():
        env = spec["environment"]
        assert env["BUBBLETEA_DISPATCH"] == "per_dc" and name == f"dispatcher-{env['BUBBLETEA_DC']}"
        assert _spec_path(spec) == spec_path
        # what the dispatcher does with it at start: serves that DC (a wrong one is a ConfigError)
        filled = {k: _defaulted(str(v)) for k, v in env.items()}
        assert served_dc(load_settings(spec_path, env=filled)) == env["BUBBLETEA_DC"]
        # otherwise the cluster's one dispatcher: environment, image, build, mounts, restarts
        assert {k: v for k, v in env.items() if k not in ("BUBBLETEA_DC", "BUBBLETEA_DISPATCH")} == one["environment"]
        for key in ("image", "build", "volumes", "restart", "stop_grace_period"):
            assert spec[key] == one[key], (name, key)
        assert (
            spec["depends_on"]
            == one["depends_on"]
            == {"redis-cluster-form": {"condition": "service_completed_successfully"}}
        )
        # healthy = its own instance beats (a real subcommand; the hostname left to the container)
        check = spec["healthcheck"]
        assert check["test"][0] == "CMD-SHELL" and '"^dispatcher $${HOSTNAME}-"' in check["test"][1]
        words = check["test"][1].split("|")[0].split()
        assert words[0] == "bubbletea" and build_parser().parse_args(words[1:]).service == "dispatcher"
        assert {k: v for k, v in check.items() if k != "test"} == {
            k: v for k, v in one["healthcheck"].items() if k != "test"
        }
        # Prometheus's dispatcher job still finds it by the name `dispatcher`
        assert spec["networks"]["default"]["aliases"] == ["dispatcher"]


def test_the_per_dc_overlay_gives_every_bubbletea_service_the_same_dispatch_mode() -> None:
    cluster, merged = _per_dc_stack()
    services = merged["services"]
    bubbletea = {n for n, s in services.items() if "REDIS_URL" in s.get("environment", {})} - {"redis-cluster-form"}
    assert {"prefill_queue", "wan_broker", "stage_worker", "decoder", "loadgen"} <= bubbletea
    for name in bubbletea:
        assert services[name]["environment"].get("BUBBLETEA_DISPATCH") == "per_dc", name
        if name in cluster["services"]:  # the rest as on the cluster
            assert {k: v for k, v in services[name]["environment"].items() if k != "BUBBLETEA_DISPATCH"} == (
                cluster["services"][name]["environment"]
            ), name
    active = _active(services)
    dispatchers = [n for n, s in active.items() if s.get("command") == DISPATCHER_CMD]
    worker = active["stage_worker"]["depends_on"]
    assert worker == {
        "redis-cluster-form": {"condition": "service_completed_successfully"},
        "wan_broker": {"condition": "service_healthy"},
        **{d: {"condition": "service_healthy"} for d in dispatchers},
    }
    for name, spec in active.items():  # nothing waits on a service that is off
        deps = spec.get("depends_on", {})
        assert set(deps) <= set(active), (name, deps)
        for dep, cond in deps.items():
            if cond == {"condition": "service_healthy"}:
                assert "healthcheck" in active[dep], (name, dep)


def test_the_default_stack_runs_one_dispatcher_for_the_run() -> None:
    """compose.yaml alone, and on the cluster: the one dispatcher, no datacenter, no dispatch mode
    set (the spec's default, `one`)."""
    cluster, _ = _per_dc_stack()
    for services in (_load("compose.yaml")["services"], cluster["services"]):
        active = _active(services)
        assert [n for n, s in active.items() if s.get("command") == DISPATCHER_CMD] == ["dispatcher"]
        for name, spec in active.items():
            env = spec.get("environment", {})
            assert "BUBBLETEA_DISPATCH" not in env and "BUBBLETEA_DC" not in env, name
