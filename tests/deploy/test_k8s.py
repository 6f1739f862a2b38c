"""The Kubernetes manifests of `deploy/k8s/`, rendered and validated (no cluster runs them here).

Each overlay is rendered with `kubectl kustomize`, and every document it yields is validated against
the newest Kubernetes schemas `kubernetes-validate` ships, strictly (an unknown field is an error).
Then what the schemas cannot see: every ConfigMap, Secret, volume claim and Service a workload names
is in the same render, each datacenter overlay runs the spec's slots of its DC plus one spare (the
slots computed with the project's own placement, `shared.policies.pipeline_plan.placement_of`), the probes and
Prometheus annotations use the ports and paths the services really serve (and compose's Prometheus
scrapes), and Redis's password only ever comes from the Secret. With a dispatcher per datacenter
(`components/dispatch-per-dc` on the control and datacenter overlays, `overlays/dispatcher-<dc>`
beside them): one dispatcher for each datacenter `dispatch_dcs` gives, each naming its DC, every
BubbleTea container in the per_dc mode, and nothing else changed.

Skipped, saying why, where `kubectl` (1.27 or newer: kustomize v5) or `kubernetes-validate` (the
`dev` extra) is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml


def kustomize_problem() -> str | None:
    """Why this kubectl cannot render the overlays (None: it can). They need kustomize v5 (kubectl
    1.27+): Debian 12's kubernetes-client is kubectl 1.20, whose kustomize knows no components."""
    if shutil.which("kubectl") is None:
        return "kubectl is not installed: it renders the kustomize overlays (kubectl 1.27 or newer)"
    out = subprocess.run(["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30)
    try:
        kustomize = str(json.loads(out.stdout).get("kustomizeVersion", ""))
    except json.JSONDecodeError:
        kustomize = ""
    major = kustomize.lstrip("v").split(".")[0]
    if not major.isdigit() or int(major) < 5:
        return f"this kubectl's kustomize ({kustomize or 'unknown'}) is older than v5: install kubectl 1.27 or newer"
    return None


if (problem := kustomize_problem()) is not None:
    pytest.skip(problem, allow_module_level=True)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')"
)

from shared.config.env import ENV_VARS  # noqa: E402
from shared.config.settings import load_settings  # noqa: E402
from shared.config.spec import load_spec  # noqa: E402
from shared.policies.pipeline_plan import dispatch_dcs, placement_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
DC_OVERLAYS = [o for o in OVERLAYS if o.startswith("dc-")]
DISPATCHER_OVERLAYS = [o for o in OVERLAYS if o.startswith("dispatcher-")]
#: The newest Kubernetes version whose schemas kubernetes-validate ships.
K8S_VERSION = kubernetes_validate.latest_version()

Doc = dict[str, Any]


@cache
def render(overlay: str) -> tuple[Doc, ...]:
    """`kubectl kustomize deploy/k8s/overlays/<overlay>`, as documents."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{out.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    assert docs, f"overlays/{overlay} renders nothing"
    return docs


def of_kind(docs: tuple[Doc, ...], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def workloads(docs: tuple[Doc, ...]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def container(workload: Doc) -> Doc:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def env_config(docs: tuple[Doc, ...], c: Doc) -> dict[str, str]:
    """The variables a container takes from ConfigMaps (`envFrom`)."""
    out: dict[str, str] = {}
    for src in c.get("envFrom", []):
        out.update(named(docs, "ConfigMap", src["configMapRef"]["name"])["data"])
    return out


def by_component(docs: tuple[Doc, ...], component: str) -> Doc:
    (w,) = [d for d in workloads(docs) if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return w


def compose_ports() -> dict[str, int]:
    """The port compose's Prometheus scrapes each service's /metrics on (docker/prometheus/prometheus.yml)."""
    conf = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    ports = {}
    for job in conf["scrape_configs"]:
        assert job["metrics_path"] == "/metrics"
        if "static_configs" in job:
            (target,) = job["static_configs"][0]["targets"]
            ports[job["job_name"]] = int(target.rsplit(":", 1)[1])
        else:
            ports[job["job_name"]] = job["dns_sd_configs"][0]["port"]
    return ports


def test_the_overlays_are_the_control_services_and_the_spec_datacenters() -> None:
    spec = load_spec(ROOT / "configs" / "demo.yaml")
    assert sorted(DC_OVERLAYS) == sorted(dc.name for dc in spec.datacenters)
    assert "control" in OVERLAYS
    per_dc = load_settings(ROOT / "configs" / "demo.yaml", env={"BUBBLETEA_DISPATCH": "per_dc"}).spec
    assert sorted(DISPATCHER_OVERLAYS) == sorted(f"dispatcher-{dc}" for dc in dispatch_dcs(per_dc))
    assert set(OVERLAYS) == {"control", *DC_OVERLAYS, *DISPATCHER_OVERLAYS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_document_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    errors = []
    for doc in render(overlay):
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc}")
    assert not errors, f"overlays/{overlay} against Kubernetes {K8S_VERSION}:\n" + "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_a_workload_names_is_in_the_render(overlay: str) -> None:
    docs = render(overlay)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert len(names) == len(docs), "two objects of one kind share a name"
    assert {d["metadata"].get("namespace") for d in docs} == {"bubbletea"}
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for v in pod.get("volumes", []):
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names
        for c in pod["containers"]:
            for src in c.get("envFrom", []):
                assert ("ConfigMap", src["configMapRef"]["name"]) in names
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = named(docs, "Secret", ref["name"])
                    assert ref["key"] in secret.get("data", {}) or ref["key"] in secret.get("stringData", {})
        if w["kind"] == "StatefulSet":  # its governing Service: headless, selecting its pods
            svc = named(docs, "Service", w["spec"]["serviceName"])
            assert svc["spec"]["clusterIP"] == "None"
            assert svc["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_bubbletea_containers_share_the_spec_settings_and_image(overlay: str) -> None:
    docs = render(overlay)
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    image = compose["x-service"]["image"]  # bubbletea:latest, what `docker compose build` tags
    spec_text = (ROOT / "configs" / "demo.yaml").read_text()
    for w in workloads(docs):
        c = container(w)
        if c["name"] == "redis":
            continue
        assert c["image"] == image
        env = env_config(docs, c)
        assert env["BUBBLETEA_RUN"] == "k8s"
        assert env["BUBBLETEA_WAN"] == "none"
        assert env["BUBBLETEA_CONFIG"] == "/etc/bubbletea/spec.yaml"
        # only settings the services know (an unknown BUBBLETEA_* would be refused at start)
        for var in [*env, *env_of(c)]:
            assert not var.startswith("BUBBLETEA_") or var in ENV_VARS, var
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/bubbletea"]
        (vol,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        assert named(docs, "ConfigMap", vol["configMap"]["name"])["data"]["spec.yaml"] == spec_text


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_redis_password_comes_from_the_secret(overlay: str) -> None:
    docs = render(overlay)
    (secret,) = of_kind(docs, "Secret")
    for w in workloads(docs):
        c = container(w)
        env = env_of(c)
        for var in ("REDIS_PASSWORD", *(["REDISCLI_AUTH"] if c["name"] == "redis" else [])):
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "password"}
        if c["name"] == "redis":
            assert '--requirepass "$REDIS_PASSWORD"' in c["args"][0]
        else:
            assert env["REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@$(REDIS_HOST):6379/0"
            assert "REDIS_HOST" in env_config(docs, c)  # defined before REDIS_URL (envFrom), so expanded
        assert "password" not in str(c.get("command", "")).lower()


def test_the_control_overlay() -> None:
    docs = render("control")
    ports = compose_ports()
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in workloads(docs)} == {
        "redis",
        "wan-broker",
        "dispatcher",
        "prefill-queue",
    }
    assert not of_kind(docs, "StatefulSet")
    door = by_component(docs, "prefill-queue")
    c = container(door)
    (http,) = c["ports"]
    assert http["containerPort"] == int(env_of(c)["BUBBLETEA_HTTP_PORT"]["value"]) == ports["prefill_queue"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": http["name"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": http["name"]}
    svc = named(docs, "Service", "prefill-queue")
    assert svc["spec"]["selector"].items() <= door["spec"]["template"]["metadata"]["labels"].items()
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == [http["name"]]
    redis = named(docs, "Service", "redis")
    assert redis["spec"]["ports"][0]["port"] == 6379
    for component, job in [
        ("prefill-queue", "prefill_queue"),
        ("wan-broker", "wan_broker"),
        ("dispatcher", "dispatcher"),
    ]:
        w = by_component(docs, component)
        notes = w["spec"]["template"]["metadata"]["annotations"]
        assert notes == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ports[job]),
            "prometheus.io/path": "/metrics",
        }
    for component in ("wan-broker", "dispatcher"):  # one per run
        assert by_component(docs, component)["spec"]["replicas"] == 1


@pytest.mark.parametrize("dc", DC_OVERLAYS)
def test_a_datacenter_overlay_runs_its_slots_and_one_spare(dc: str, tmp_path: Path) -> None:
    docs = render(dc)
    assert not of_kind(docs, "Deployment")  # the control services run once, in overlays/control
    (sts,) = of_kind(docs, "StatefulSet")
    c = container(sts)
    env = env_of(c)
    # the slots, from the spec the pods really get (the ConfigMap), with the project's own placement
    (spec_map,) = [m for m in of_kind(docs, "ConfigMap") if "spec.yaml" in m["data"]]
    (tmp_path / "spec.yaml").write_text(spec_map["data"]["spec.yaml"])
    spec = load_spec(tmp_path / "spec.yaml")
    assert spec.training.recovers, "a spare is only useful with checkpoints (training.checkpoint_every > 0)"
    placement = placement_of(spec)
    slots = sum(1 for home in placement.stage_dc if home == dc) * placement.dp
    assert slots > 0
    assert sts["spec"]["replicas"] == slots + 1, f"{dc}: {slots} slots + 1 spare"
    assert sts["metadata"]["name"].endswith(dc)
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # a spare is never ready: do not wait on it
    assert env["BUBBLETEA_DC"] == {"name": "BUBBLETEA_DC", "value": dc}
    assert env["BUBBLETEA_PLANE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # the readiness probe is the one endpoint a worker serves: /metrics on BUBBLETEA_METRICS_PORT
    metrics_port = int(env_config(docs, c)["BUBBLETEA_METRICS_PORT"])
    assert metrics_port == compose_ports()["stage_worker"]
    (port,) = c["ports"]
    assert port["containerPort"] == metrics_port
    assert c["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": port["name"]}
    notes = sts["spec"]["template"]["metadata"]["annotations"]
    assert notes == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(metrics_port),
        "prometheus.io/path": "/metrics",
    }
    # checkpoints on a volume every worker of the DC shares
    state_dir = env["BUBBLETEA_STATE_DIR"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == state_dir]
    (vol,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    pvc = named(docs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_every_cluster_shares_the_run_and_the_password() -> None:
    """The overlays are applied in separate clusters: what must agree, agrees."""
    runs, passwords = set(), set()
    for overlay in OVERLAYS:
        docs = render(overlay)
        (secret,) = of_kind(docs, "Secret")
        passwords.add(secret["data"]["password"])
        for w in workloads(docs):
            if container(w)["name"] != "redis":
                runs.add(env_config(docs, container(w))["BUBBLETEA_RUN"])
    assert len(runs) == 1
    assert len(passwords) == 1


@pytest.mark.parametrize("dc", DC_OVERLAYS)
def test_a_drain_takes_one_worker_at_a_time_and_a_spare_survives_its_host(dc: str) -> None:
    """Issue 49: a PodDisruptionBudget of one (a drain never evicts two workers of a DC at once:
    two leaving at once stop the run), workers spread over hosts, the grace to leave at a step
    boundary, and containers without privileges."""
    docs = render(dc)
    (sts,) = of_kind(docs, "StatefulSet")
    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"]["bubbletea.dev/datacenter"] == dc  # this DC's workers only
    pod = sts["spec"]["template"]["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    assert pod["terminationGracePeriodSeconds"] >= 60
    sc = container(sts)["securityContext"]
    assert sc == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_redis_cluster_component_points_an_overlay_at_a_cluster(overlay: str, tmp_path: Path) -> None:
    """components/redis-cluster, added to an overlay as the README says: every BubbleTea container's
    REDIS_URL is a redis+cluster:// URL (the Secret's password, REDIS_HOST from the env ConfigMap,
    database 0), REDIS_HOST names the cluster, the control overlay's own Redis is gone, and the
    render still validates and names nothing it lacks; the rest is the overlay's."""
    import os

    k8s = os.path.relpath(K8S, tmp_path)  # kustomize takes no absolute paths to other kustomizations
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{k8s}/overlays/{overlay}]\ncomponents: [{k8s}/components/redis-cluster]\n"
    )
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    before = render(overlay)
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"]
    gone = {(d["kind"], d["metadata"]["name"]) for d in before} - {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {n for _, n in gone if not n.startswith("bubbletea-env")} == (
        {"redis", "redis-data"} if overlay == "control" else set()
    )
    assert [container(w)["name"] for w in workloads(docs)] == [
        container(w)["name"] for w in workloads(before) if container(w)["name"] != "redis"
    ]
    for w in workloads(docs):
        c = container(w)
        env = env_of(c)
        assert env["REDIS_URL"]["value"] == "redis+cluster://:$(REDIS_PASSWORD)@$(REDIS_HOST):6379"
        assert env_config(docs, c)["REDIS_HOST"] == "redis-cluster"  # defined before REDIS_URL (envFrom)
        assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"]
        old = container(next(b for b in workloads(before) if container(b)["name"] == c["name"]))
        assert {k: v for k, v in env.items() if k != "REDIS_URL"} == {
            k: v for k, v in env_of(old).items() if k != "REDIS_URL"
        }
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for w in workloads(docs):  # every ConfigMap and claim it names is in the render
        pod = w["spec"]["template"]["spec"]
        for src in container(w).get("envFrom", []):
            assert ("ConfigMap", src["configMapRef"]["name"]) in names
        for v in pod.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names


def with_components(overlay: str, components: list[str], tmp_path: Path) -> tuple[Doc, ...]:
    """An overlay with components added after it, as the README says (a kustomization of one's own)."""
    import os

    here = tmp_path / overlay
    here.mkdir(parents=True)
    k8s = os.path.relpath(K8S, here)  # kustomize takes no absolute paths to other kustomizations
    (here / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{k8s}/overlays/{overlay}]\n"
        f"components: [{', '.join(f'{k8s}/components/{c}' for c in components)}]\n"
    )
    out = subprocess.run(["kubectl", "kustomize", str(here)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def effective_env(docs: tuple[Doc, ...], c: Doc) -> dict[str, str]:
    """What a container's process sees of the plain settings: `env` over `envFrom`."""
    return {**env_config(docs, c), **{k: e["value"] for k, e in env_of(c).items() if "value" in e}}


def dispatchers(docs: tuple[Doc, ...]) -> list[Doc]:
    return [w for w in workloads(docs) if container(w)["command"] == ["python", "-m", "services.dispatcher"]]


@pytest.mark.parametrize("redis", [[], ["redis-cluster"]], ids=["one-redis", "redis-cluster"])
def test_a_dispatcher_per_datacenter_switches_the_whole_run(redis: list[str], tmp_path: Path) -> None:
    """The control and datacenter overlays with components/dispatch-per-dc, the dispatcher-<dc>
    overlays beside them (on one Redis, or with the redis-cluster component everywhere): a
    dispatcher for each datacenter dispatch_dcs gives and no other, each serving its DC as the
    dispatcher itself accepts it, every BubbleTea container in the per_dc mode, the rest as before."""
    from services.dispatcher.serve import served_dc

    renders = {o: with_components(o, ["dispatch-per-dc", *redis], tmp_path) for o in ["control", *DC_OVERLAYS]}
    for o in DISPATCHER_OVERLAYS:
        renders[o] = with_components(o, redis, tmp_path) if redis else render(o)
    served = []
    for overlay, docs in renders.items():
        for doc in docs:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        for w in workloads(docs):
            c = container(w)
            if c["name"] == "redis":
                continue
            env = effective_env(docs, c)
            assert env["BUBBLETEA_DISPATCH"] == "per_dc", (overlay, w["metadata"]["name"])
            if w in dispatchers(docs):
                (spec_map,) = [m for m in of_kind(docs, "ConfigMap") if "spec.yaml" in m["data"]]
                (tmp_path / "spec.yaml").write_text(spec_map["data"]["spec.yaml"])
                settings = load_settings(tmp_path / "spec.yaml", env=env)
                served.append(served_dc(settings))
                assert w["metadata"]["name"] == f"dispatcher-{served[-1]}" == overlay
                assert w["spec"]["selector"]["matchLabels"]["bubbletea.dev/datacenter"] == served[-1]
                assert served[-1] in dispatch_dcs(settings.spec)
    assert sorted(served) == sorted(dispatch_dcs(settings.spec))  # one per DC that holds stages
    assert not dispatchers(renders["control"])  # the run's one dispatcher is gone
    # the rest of the control overlay, and every datacenter's, as before but for the mode
    for overlay in ["control", *DC_OVERLAYS]:
        before = with_components(overlay, redis, tmp_path / "before") if redis else render(overlay)
        after = {container(w)["name"]: w for w in workloads(renders[overlay])}
        assert set(after) == {container(w)["name"] for w in workloads(before)} - {"dispatcher"}
        for w in workloads(before):
            if container(w)["name"] in after and container(w)["name"] != "redis":
                c, old = container(after[container(w)["name"]]), container(w)
                assert effective_env(renders[overlay], c) == {
                    **effective_env(before, old),
                    "BUBBLETEA_DISPATCH": "per_dc",
                }
                assert {k: v for k, v in c.items() if k not in ("env", "envFrom")} == {
                    k: v for k, v in old.items() if k not in ("env", "envFrom")
                }


@pytest.mark.parametrize("overlay", DISPATCHER_OVERLAYS)
def test_a_datacenter_dispatcher_is_the_control_overlays_dispatcher_for_its_dc(overlay: str) -> None:
    """Probes, ports, annotations, resources, one replica with Recreate: the run's dispatcher's; its
    own name, labels and selector (its DC's), and BUBBLETEA_DC and BUBBLETEA_DISPATCH added."""
    dc = overlay.removeprefix("dispatcher-")
    (mine,) = dispatchers(render(overlay))
    (one,) = dispatchers(render("control"))
    assert not [w for w in workloads(render(overlay)) if w is not mine]  # the dispatcher alone
    assert mine["metadata"]["name"] == f"dispatcher-{dc}"
    labels = mine["spec"]["template"]["metadata"]["labels"]
    assert labels == {**one["spec"]["template"]["metadata"]["labels"], "bubbletea.dev/datacenter": dc}
    assert mine["spec"]["selector"]["matchLabels"] == {
        **one["spec"]["selector"]["matchLabels"],
        "bubbletea.dev/datacenter": dc,
    }
    assert mine["spec"]["replicas"] == one["spec"]["replicas"] == 1
    assert mine["spec"]["strategy"] == one["spec"]["strategy"] == {"type": "Recreate"}
    assert mine["spec"]["template"]["metadata"]["annotations"] == one["spec"]["template"]["metadata"]["annotations"]
    c, c1 = container(mine), container(one)
    assert {k: v for k, v in c.items() if k not in ("env", "envFrom")} == {
        k: v for k, v in c1.items() if k not in ("env", "envFrom")
    }
    env = env_of(c)
    assert env.pop("BUBBLETEA_DC") == {"name": "BUBBLETEA_DC", "value": dc}
    assert env.pop("BUBBLETEA_DISPATCH") == {"name": "BUBBLETEA_DISPATCH", "value": "per_dc"}
    assert {k: v for k, v in env.items() if k != "REDIS_PASSWORD"} == {
        k: v for k, v in env_of(c1).items() if k != "REDIS_PASSWORD"
    }
    assert env_config(render(overlay), c) == env_config(render("control"), c1)  # Redis where control's is


@pytest.mark.parametrize("overlay", ["control", *DC_OVERLAYS])
def test_without_the_component_the_run_has_one_dispatcher(overlay: str) -> None:
    docs = render(overlay)
    for w in workloads(docs):
        assert "BUBBLETEA_DISPATCH" not in effective_env(docs, container(w))  # the spec's: one
    assert len(dispatchers(docs)) == (1 if overlay == "control" else 0)
