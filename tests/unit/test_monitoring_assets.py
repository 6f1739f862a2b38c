"""The monitoring assets agree with the services: every metric each panel of the Grafana dashboard
queries is one a service exposes (under the job that scrapes it), read from the real registries of
every metrics class of the services Prometheus scrapes, Prometheus scrapes the four compose services,
Grafana's provisioning points at that Prometheus and at the dashboard's folder, and each service's
metrics class builds and writes an exposition that parses, with help text on every metric."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.dispatcher.metrics import DispatcherMetrics
from services.prefill_queue.metrics import Metrics as FrontDoorMetrics
from services.stage_worker.metrics import WorkerMetrics
from services.wan_broker.metrics import BrokerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker/grafana/dashboards/bubbletea.json"
PROMETHEUS = ROOT / "docker/prometheus/prometheus.yml"
DATASOURCE = ROOT / "docker/grafana/provisioning/datasources/prometheus.yml"
PROVIDER = ROOT / "docker/grafana/provisioning/dashboards/bubbletea.yml"

#: Dashboard metrics that another change adds to a service; allowed to be missing until it lands.
PENDING: set[str] = set()

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def service_metrics() -> dict[str, Any]:
    """Each compose service's real metrics object (no mock), keyed by the Prometheus job that scrapes it."""
    return {
        "prefill_queue": FrontDoorMetrics(),
        "dispatcher": DispatcherMetrics("run", "m"),
        "stage_worker": WorkerMetrics("run", "r0s0", "m"),
        "wan_broker": BrokerMetrics("run"),
    }


def registries() -> dict[str, CollectorRegistry]:
    """Each compose service's registry, keyed by the Prometheus job that scrapes it."""
    return {job: m.registry for job, m in service_metrics().items()}


def exposed(registry: CollectorRegistry) -> set[str]:
    """The sample names a registry can expose, series or not yet (a labelled metric has none until used)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in registry.collect():
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
        names |= {s.name for s in family.samples}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)  # label lists
    out = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group() in PROMQL_WORDS:
            continue  # a function or an aggregation, or a keyword
        out.add(m.group())
    return out


def job_selectors(expr: str) -> set[tuple[str, str]]:
    """(metric, job) for every selector of `expr` that names a job."""
    out = set()
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr):
        job = re.search(r'\bjob\s*=\s*"([^"]*)"', m.group(2))
        if job:
            out.add((m.group(1), job.group(1)))
    return out


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(items: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel of the dashboard, those inside a (collapsed) row's `panels` too; rows left out."""
    for p in dashboard()["panels"] if items is None else items:
        if p.get("type") == "row":
            yield from panels(p.get("panels", []))
        else:
            yield p


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p.get("targets", [])]


def test_the_expression_reader_finds_metric_names_only() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, src_dc) (rate(a:b_bucket{job="x", le!="1"}[$__rate_interval])))'
    assert metric_names(expr) == {"a:b_bucket"}
    assert metric_names("sum(rate(x_total[1m])) / sum(rate(y_total[1m])) or vector(0)") == {"x_total", "y_total"}
    assert metric_names("max by (stream, group) (lag)") == {"lag"}
    assert job_selectors('rate(x{job="a"}[1m]) + y{le="1"}') == {("x", "a")}


def test_every_dashboard_metric_is_exposed_by_a_service() -> None:
    regs = {job: exposed(r) for job, r in registries().items()}
    every = set().union(*regs.values())
    used = set().union(*(metric_names(e) for e in exprs()))
    assert len(used) > 20  # the reader found the metrics (a broken reader would find none)
    missing = used - every - PENDING
    assert not missing, f"the dashboard queries metrics no service exposes: {sorted(missing)}"
    for e in exprs():
        for name, job in job_selectors(e):
            assert job in regs, f"{e}: no Prometheus job {job!r}"
            assert name in regs[job], f"{e}: job {job} does not expose {name}"


def test_every_panel_queries_only_metrics_a_service_exports() -> None:
    """Panel by panel (the failure names the panel): each queries some metric, and every metric
    name in its PromQL is a sample a service's real registry exports (a histogram's `_bucket`,
    `_sum` and `_count`, a counter's `_total`)."""
    every = set().union(*(exposed(r) for r in registries().values()))
    seen = 0
    for p in panels():
        used = set().union(*(metric_names(t["expr"]) for t in p.get("targets", [])))
        assert used, f"panel {p['title']!r} queries no metric"
        missing = used - every - PENDING
        assert not missing, f"panel {p['title']!r} queries metrics no service exports: {sorted(missing)}"
        seen += 1
    assert seen == len(list(panels())) > 20


def test_the_registries_read_are_every_scraped_service_s_metrics_classes() -> None:
    """The registries this file checks the dashboard against are built from every metrics class
    of each service Prometheus scrapes (`services/<job>/metrics.py`): a metrics class added to a
    service cannot be missed here, and with it the metrics it exports."""
    built = {job: type(m) for job, m in service_metrics().items()}
    jobs = {j["job_name"] for j in yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))["scrape_configs"]}
    assert set(built) == jobs
    for job in jobs:
        module = importlib.import_module(f"services.{job}.metrics")
        classes = {
            c for _, c in inspect.getmembers(module, inspect.isclass)
            if c.__module__ == module.__name__ and c.__name__.endswith("Metrics")
        }  # fmt: skip
        assert classes == {built[job]}, f"services/{job}/metrics.py: {classes} against {built[job]} built here"


@pytest.mark.parametrize("job", ["prefill_queue", "dispatcher", "stage_worker", "wan_broker"])
def test_the_names_read_as_exported_include_every_sample_written(job: str) -> None:
    """`exposed` (which the checks above trust) holds every sample name the registry writes."""
    registry = registries()[job]
    written = {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert written and written <= exposed(registry), sorted(written - exposed(registry))


def test_the_dashboard_covers_what_the_issue_asks_for() -> None:
    used = set().union(*(metric_names(e) for e in exprs()))
    for name in (
        "bubbletea:bubble_seconds_total",
        "bubbletea:prefill_seconds_total",
        "bubbletea:bubble_fill_ratio",
        "bubbletea:iteration_seconds_bucket",
        "bubbletea:training_lag_seconds_total",
        "bubbletea:bubble_start_queued_seconds_bucket",
        "bubbletea:bubbles_opened_empty_total",
        "bubbletea:bubble_prediction_error_seconds_bucket",
        "bubbletea:num_requests_waiting",
        "bubbletea:time_to_first_token_seconds_bucket",
        "bubbletea:request_total",
        "bubbletea:stream_lag",
        "bubbletea:stream_pending",
        "bubbletea:dead_lettered",
        "bubbletea:wan_link_utilization",
        "bubbletea:serving",
    ):
        assert name in used, name


def test_the_dashboard_is_a_grafana_dashboard_on_the_provisioned_datasource() -> None:
    d = dashboard()
    assert d["schemaVersion"] == 39 and d["uid"] and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        assert p["type"] in ("timeseries", "stat"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}, p["title"]
        assert p["description"] and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"] and t["datasource"]["uid"] == "prometheus"
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_prometheus_scrapes_the_four_compose_services() -> None:
    conf = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text(encoding="utf-8"))
    assert conf["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    assert set(jobs) == {"prefill_queue", "dispatcher", "wan_broker", "stage_worker"}
    assert set(jobs) <= set(compose["services"])  # the job names are the compose service names
    assert jobs["prefill_queue"]["static_configs"] == [{"targets": ["prefill_queue:8000"]}]
    for name in ("dispatcher", "wan_broker", "stage_worker"):
        (sd,) = jobs[name]["dns_sd_configs"]  # one A record per replica: every scaled worker is found
        assert sd["names"] == [name] and sd["type"] == "A" and sd["port"] == 9100
    for j in jobs.values():
        assert j.get("metrics_path", "/metrics") == "/metrics"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    (ds,) = yaml.safe_load(DATASOURCE.read_text(encoding="utf-8"))["datasources"]
    assert (ds["type"], ds["uid"], ds["url"]) == ("prometheus", "prometheus", "http://prometheus:9090")
    (provider,) = yaml.safe_load(PROVIDER.read_text(encoding="utf-8"))["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_compose_mounts_the_monitoring_assets_where_they_are_read() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text(encoding="utf-8"))["services"]
    if "prometheus" not in services:
        pytest.skip("compose.yaml has no monitoring profile yet")
    mounts = {}  # (service, path inside) -> path here
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            here, inside = volume.split(":")[:2]
            mounts[(name, inside)] = here
    assert mounts[("prometheus", "/etc/prometheus/prometheus.yml")] == "./docker/prometheus/prometheus.yml"
    assert mounts[("grafana", "/etc/grafana/provisioning")] == "./docker/grafana/provisioning"
    assert mounts[("grafana", "/var/lib/grafana/dashboards")] == "./docker/grafana/dashboards"
    assert all((ROOT / here).exists() for here in mounts.values())


@pytest.mark.parametrize("job", ["prefill_queue", "dispatcher", "stage_worker", "wan_broker"])
def test_each_service_exposition_parses_with_help_on_every_metric(job: str) -> None:
    registry = registries()[job]
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    ours = [f for f in families if f.name.startswith("bubbletea")]
    assert ours and any(f.name.startswith("process_") for f in families)  # and the process collector's
    for f in ours:
        assert len(f.documentation) > 15, f"{f.name} needs help text saying what it measures"
    if job != "prefill_queue":  # the bus services' metrics are all named bubbletea:<what>
        assert all(f.name.startswith("bubbletea:") for f in ours), [f.name for f in ours]
