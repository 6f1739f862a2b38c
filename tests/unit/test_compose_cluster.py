"""compose.cluster.yaml, the overlay that runs compose.yaml's stack on a Redis Cluster. No Docker
engine runs here, so the two files are merged as compose merges them (mappings merged, sequences
appended, ``!override`` replacing) and the result is checked: six cluster-enabled nodes with the
single redis's settings and a volume each, a one-shot service forming them with a command the real
parser accepts, every BubbleTea service on the cluster's URL and waiting for it, no active service
depending on one that is off; and compose.yaml alone (the default) as it was: one redis."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from bubbletea.commands import build_parser
from shared.config import env_values
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
