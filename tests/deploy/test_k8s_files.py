"""The Kubernetes manifests of `deploy/k8s/` as files, with no kubectl: what a dispatcher per
datacenter needs of them, read with PyYAML. `tests/deploy/test_k8s.py` renders and validates the same
with kubectl where it has one (1.27+); this runs everywhere.

A dispatcher per datacenter (`bubbletea.dispatch: per_dc`) is `components/dispatch-per-dc` on the
control overlay and each datacenter's (the mode in the settings every container reads, the run's
one dispatcher dropped) plus `overlays/dispatcher-<dc>` for each datacenter the project's own
`dispatch_dcs` gives for the spec the pods mount, each naming its DC as the dispatcher's
`served_dc` accepts it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from services.dispatcher.serve import served_dc
from shared.config.settings import load_settings
from shared.policies.pipeline_plan import dispatch_dcs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SPEC = K8S / "base" / "spec.yaml"
DISPATCHER_LABEL = "app.kubernetes.io/component"
DC_LABEL = "bubbletea.dev/datacenter"


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _literals(generator: dict[str, Any]) -> dict[str, str]:
    return dict(line.split("=", 1) for line in generator["literals"])


def _dispatcher_overlays() -> dict[str, Path]:
    return {p.name: p for p in sorted((K8S / "overlays").glob("dispatcher-*")) if (p / "kustomization.yaml").is_file()}


def _per_dc_dcs() -> list[str | None]:
    """The dispatchers a per_dc run of the spec the pods mount has, as the services compute them."""
    return dispatch_dcs(load_settings(SPEC, env={"BUBBLETEA_DISPATCH": "per_dc"}).spec)


def test_the_pods_mount_the_demo_spec() -> None:
    assert SPEC.read_text(encoding="utf-8") == (ROOT / "configs" / "demo.yaml").read_text(encoding="utf-8")


def test_one_dispatcher_overlay_for_each_datacenter_that_holds_stages() -> None:
    dcs = _per_dc_dcs()
    assert dcs and None not in dcs
    assert sorted(_dispatcher_overlays()) == sorted(f"dispatcher-{dc}" for dc in dcs)


def test_each_dispatcher_overlay_is_the_dispatcher_named_and_labelled_for_its_datacenter() -> None:
    for name, path in _dispatcher_overlays().items():
        dc = name.removeprefix("dispatcher-")
        k = _load(path / "kustomization.yaml")
        assert k["resources"] == ["../../dispatcher"] and k["components"] == ["../../base"], name
        assert k["nameSuffix"] == f"-{dc}", name
        (labels,) = k["labels"]
        assert labels == {"pairs": {DC_LABEL: dc}, "includeSelectors": True}, name  # selects its own pods only
        (patch,) = k["patches"]
        body = yaml.safe_load(patch["patch"])
        assert (body["kind"], body["metadata"]["name"]) == ("Deployment", "dispatcher")
        (container,) = body["spec"]["template"]["spec"]["containers"]
        assert container["name"] == "dispatcher"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env == {"BUBBLETEA_DC": dc, "BUBBLETEA_DISPATCH": "per_dc"}, name
        # what the dispatcher does with them at start: serves that DC (a wrong one is a ConfigError)
        assert served_dc(load_settings(SPEC, env=env)) == dc


def test_the_dispatcher_is_one_deployment_the_control_overlay_and_the_dispatcher_overlays_share() -> None:
    (deployment,) = [d for d in yaml.safe_load_all((K8S / "dispatcher" / "dispatcher.yaml").read_text()) if d]
    assert (deployment["kind"], deployment["metadata"]["name"]) == ("Deployment", "dispatcher")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "services.dispatcher"]
    assert pod["metadata"]["labels"] == {DISPATCHER_LABEL: "dispatcher"}  # no DC: the run's one, as it is
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert _load(K8S / "dispatcher" / "kustomization.yaml")["resources"] == ["dispatcher.yaml"]
    assert "../../dispatcher" in _load(K8S / "overlays" / "control" / "kustomization.yaml")["resources"]


def test_the_component_switches_an_overlay_to_per_dc_and_drops_the_runs_one_dispatcher() -> None:
    k = _load(K8S / "components" / "dispatch-per-dc" / "kustomization.yaml")
    assert k["kind"] == "Component"
    (generator,) = k["configMapGenerator"]
    assert generator["name"] == "bubbletea-env" and generator["behavior"] == "merge"
    assert _literals(generator) == {"BUBBLETEA_DISPATCH": "per_dc"}  # what every container reads (envFrom)
    (drop,) = k["patches"]
    assert yaml.safe_load(drop["patch"])["$patch"] == "delete"
    target = drop["target"]
    assert target["kind"] == "Deployment" and "name" not in target
    # the control overlay's dispatcher and no datacenter's: theirs carry their DC's label
    assert target["labelSelector"] == f"{DISPATCHER_LABEL}=dispatcher,!{DC_LABEL}"


def test_the_redis_cluster_component_points_every_dispatcher_at_the_cluster() -> None:
    k = _load(K8S / "components" / "redis-cluster" / "kustomization.yaml")
    (target,) = [p["target"]["name"] for p in k["patches"] if "dispatcher" in p["patch"]]
    names = ["dispatcher", *_dispatcher_overlays()]
    assert all(re.search(target, n) for n in names), (target, names)


def test_the_default_deployment_runs_one_dispatcher_for_the_run() -> None:
    """Without the component nothing sets the mode: the spec's default, `one`."""
    base = _load(K8S / "base" / "kustomization.yaml")
    (env,) = [g for g in base["configMapGenerator"] if g["name"] == "bubbletea-env"]
    assert "BUBBLETEA_DISPATCH" not in _literals(env)
    assert load_settings(SPEC, env={}).spec.bubbletea.dispatch == "one"
    for path in (K8S / "overlays").glob("*/kustomization.yaml"):
        components = _load(path).get("components", [])
        assert not [c for c in components if c.endswith("/dispatch-per-dc")], path
