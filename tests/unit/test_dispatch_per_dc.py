"""A dispatcher per datacenter (`bubbletea.dispatch: per_dc`): which dispatchers a run has and what
each serves, the keys each owns, the configuration a dispatcher refuses, the processes a launcher
starts, and where the front door sends a request (`services/prefill_queue/routing.py`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.crc import key_slot

from bubbletea.launcher.services import DISPATCHER, PREFILL_QUEUE, STAGE_WORKER, instances
from bubbletea.launcher.wan_modes import WorkerLaunch
from services.dispatcher.serve import served_dc
from services.prefill_queue.routing import DcRouting
from shared.config.settings import Settings
from shared.config.spec import ClusterSpec, ConfigError, parse_spec
from shared.policies.dc_routing import DcSnapshot, RouteWhy
from shared.policies.pipeline_plan import dispatch_dc, dispatch_dcs, placement_of, stages_of
from shared.policies.prefill_cost import PrefillCostModel
from shared.wire import PrefillRequest, keys

SPEC: dict[str, Any] = {
    "name": "per-dc",
    "datacenters": [{"name": "dc-a", "gpus": 2}, {"name": "dc-b", "gpus": 2}, {"name": "dc-c", "gpus": 2}],
    "model": {"layers": 4, "d_model": 32, "heads": 4, "seq_len": 16, "vocab": 256},
    "parallelism": {"pp": 2, "dp": 2, "tp": 1},
}


def spec(dispatch: str = "per_dc") -> ClusterSpec:
    return parse_spec({**SPEC, "bubbletea": {"dispatch": dispatch}})


def test_a_run_has_one_dispatcher_or_one_per_datacenter_that_holds_stages() -> None:
    one, per_dc = spec("one"), spec()
    assert one.bubbletea.dispatch == "one" == parse_spec(SPEC).bubbletea.dispatch  # the default
    assert dispatch_dcs(one) == [None] and stages_of(one, None) == [0, 1]
    assert [dispatch_dc(one, k) for k in (0, 1)] == [None, None]
    stage_dc = placement_of(per_dc).stage_dc
    assert dispatch_dcs(per_dc) == list(dict.fromkeys(stage_dc)) and len(dispatch_dcs(per_dc)) == 2
    assert "dc-c" not in dispatch_dcs(per_dc)  # no stage there: no bubbles to fill
    for k, dc in enumerate(stage_dc):
        assert dispatch_dc(per_dc, k) == dc and stages_of(per_dc, dc) == [k]


def test_each_datacenter_owns_its_keys_under_a_hash_tag_of_its_own() -> None:
    builders: list[Callable[..., str]] = [
        keys.bubbles_stream,
        keys.prefill_reports_stream,
        keys.prefill_requests_stream,
        keys.dispatcher_lease_key,
        keys.dispatcher_measured_key,
        keys.prefill_inflight_key,
        lambda run, dc=None: keys.fill_stream(run, 0, 1, dc),
        lambda run, dc=None: keys.prefill_request_key(run, "q1", dc),
        lambda run, dc=None: keys.prefill_results_stream(run, "door-1", dc),
        lambda run, dc=None: keys.prefill_snapshot_key(run, "q1", 3, dc),
    ]
    for build in builders:
        run_wide, a, b = build("r1"), build("r1", "dc-a"), build("r1", "dc-b")
        # the run's with one dispatcher; with one per datacenter, each datacenter's own tag: what one
        # script or replicated pipeline writes (a record, its answer, the report naming it) shares it
        assert [keys.hash_tag(k) for k in (run_wide, a, b)] == ["r1", "r1:dc-a", "r1:dc-b"]
        assert all(fnmatch.fnmatchcase(k, keys.run_pattern("r1")) for k in (run_wide, a, b))
        assert not fnmatch.fnmatchcase(a, keys.run_pattern("r")) and not fnmatch.fnmatchcase(a, keys.run_pattern("r1:"))
    assert keys.hash_tag(keys.dc_snapshot_key("r1", "dc-a")) == "r1:dc-a"
    # so one run's datacenters hash to slots of their own (a cluster spreads them over its masters)
    assert len({key_slot(keys.bubbles_stream("r1", dc).encode()) for dc in (None, "dc-a", "dc-b")}) == 3
    # what every datacenter shares stays the run's: a client's key, the readiness verdicts
    assert keys.hash_tag(keys.idempotency_key("r1", "k")) == "r1"
    with pytest.raises(ValueError, match="datacenter name"):
        keys.bubbles_stream("r1", "dc{a}")


def settings(dc: str | None, dispatch: str = "per_dc") -> Settings:
    return Settings(spec=spec(dispatch), spec_path=Path("spec.yaml"), dc=dc)


def test_a_dispatcher_serves_the_datacenter_bubbletea_dc_names_and_refuses_none_or_another() -> None:
    assert served_dc(settings(None, "one")) is None
    assert served_dc(settings("dc-a", "one")) is None  # one for the run: BUBBLETEA_DC is the workers'
    a = dispatch_dcs(spec())[0]
    assert served_dc(settings(a)) == a
    with pytest.raises(ConfigError, match="BUBBLETEA_DC is not set"):
        served_dc(settings(None))
    with pytest.raises(ConfigError, match=r"BUBBLETEA_DC is 'dc-c'.*the datacenters that hold stages"):
        served_dc(settings("dc-c"))


def test_a_launcher_starts_a_dispatcher_per_datacenter_each_naming_it() -> None:
    per_dc, one = spec(), spec("one")
    launches = [WorkerLaunch(env={"i": str(i)}) for i in range(4)]
    got = instances(DISPATCHER, per_dc, launches)
    assert [(label, launch.env) for label, launch in got] == [
        (f"dispatcher-{dc}", {"BUBBLETEA_DC": dc}) for dc in dispatch_dcs(per_dc)
    ]
    assert [label for label, _ in instances(DISPATCHER, one, launches)] == ["dispatcher"]
    assert [label for label, _ in instances(PREFILL_QUEUE, per_dc, launches)] == ["prefill_queue"]
    workers = instances(STAGE_WORKER, per_dc, launches)
    assert [label for label, _ in workers] == [f"stage_worker-{i}" for i in range(4)]
    assert [launch for _, launch in workers] == launches


def request(objective: float | None = None, tokens: int = 8) -> PrefillRequest:
    return PrefillRequest(
        id="r", model="m", tokens=(1,) * tokens, submitted=0.0, deadline=100.0, reply_to="x", objective=objective
    )


def board(dc: str, ahead_s: float, rate: float | None = 1.0, at: float = 0.0, ready: bool = True) -> DcSnapshot:
    return DcSnapshot(dc=dc, ready=ready, ahead_s=ahead_s, rate=rate, at=at)


def test_the_front_door_takes_the_datacenters_in_turn_until_a_snapshot_is_read() -> None:
    routing = DcRouting("r1", ["dc-a", "dc-b"], PrefillCostModel())
    got = [routing.place(request(), now=0.0) for _ in range(4)]
    assert [dc for dc, _ in got] == ["dc-a", "dc-b", "dc-a", "dc-b"]
    assert {r.why for _, r in got} == {RouteWhy.NONE_FRESH}


def test_the_front_door_routes_to_the_soonest_and_counts_what_it_sent_there() -> None:
    cost = PrefillCostModel()
    own = cost.predict(8)
    routing = DcRouting("r1", ["dc-a", "dc-b"], cost)
    routing.router.published(board("dc-a", ahead_s=0.0))
    routing.router.published(board("dc-b", ahead_s=1.5 * own))
    got = [routing.place(request(), now=0.0) for _ in range(3)]
    # a (0 queued), a again (1 request's worth against 1.5), then b (1.5 against 2)
    assert [dc for dc, _ in got] == ["dc-a", "dc-a", "dc-b"]
    assert {r.why for _, r in got} == {RouteWhy.SOONEST}


def test_a_request_no_datacenter_meets_is_judged_by_the_least_queued_dispatcher() -> None:
    """Its objective met nowhere: the front door sends it where the least is queued, and that
    dispatcher applies placement's rule (the decoder, or a 429) with its own state."""
    routing = DcRouting("r1", ["dc-a", "dc-b"], PrefillCostModel())
    routing.router.published(board("dc-a", ahead_s=5.0))
    routing.router.published(board("dc-b", ahead_s=3.0))
    routing.router.published(board("dc-c", ahead_s=0.0, ready=False))  # refuses: never chosen
    dc, route = routing.place(request(objective=0.5), now=0.0)
    assert (dc, route.why, route.dc) == ("dc-b", RouteWhy.NONE_MEETS, None)


def test_bubbletea_dispatch_sets_it_for_every_service_and_refuses_another_value(tmp_path: Path) -> None:
    from shared.config.settings import load_settings

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    assert load_settings(path, env={}).spec.bubbletea.dispatch == "one"
    assert load_settings(path, env={"BUBBLETEA_DISPATCH": "per_dc"}).spec.bubbletea.dispatch == "per_dc"
    with pytest.raises(ConfigError, match="BUBBLETEA_DISPATCH"):
        load_settings(path, env={"BUBBLETEA_DISPATCH": "per-datacenter"})
