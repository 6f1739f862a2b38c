"""The kernel WAN plan (shared/dataplane/kernel_net.py) for the shipped specs: names the kernel accepts and
that two runs never share, addresses in the right subnets, one htb leaf per worker address and
destination with the right ceil, the commands consistent with each other, every slot addressed."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from shared.config.spec import ClusterSpec, load_spec, parse_spec
from shared.dataplane.htb import MAX_BURST_S, MIN_BURST, burst_bytes, gso_segments
from shared.dataplane.kernel_net import (
    DEFAULT_CLASSID,
    IFNAME_MAX,
    KernelPlan,
    link_rates,
    local_index,
    plan_kernel_net,
    run_base,
    run_tag,
)
from shared.policies.pipeline_plan import placement_of

CONFIGS = Path(__file__).parents[2] / "configs"
SPECS = ["demo.yaml", "wan-bound.yaml"]


def spec_of(name: str) -> ClusterSpec:
    return load_spec(CONFIGS / name)


@pytest.fixture(params=SPECS)
def spec(request: pytest.FixtureRequest) -> ClusterSpec:
    return spec_of(request.param)


@pytest.fixture
def plan(spec: ClusterSpec) -> KernelPlan:
    return plan_kernel_net(spec, "run-1")


def test_names_fit_the_kernel_and_are_unique(plan: KernelPlan) -> None:
    assert all(len(n) <= IFNAME_MAX for n in plan.interfaces)
    assert len(set(plan.interfaces)) == len(plan.interfaces)
    assert len(set(plan.namespaces)) == len(plan.namespaces) == len(plan.dcs)


def test_two_runs_get_disjoint_names(spec: ClusterSpec) -> None:
    a, b = plan_kernel_net(spec, "run-1"), plan_kernel_net(spec, "run-2")
    assert not set(a.namespaces) & set(b.namespaces)
    assert not set(a.interfaces) & set(b.interfaces)
    assert plan_kernel_net(spec, "run-1") == a  # stable: a rerun finds a crashed run's leftovers


def test_addresses_are_unique_and_in_their_dcs_subnet(spec: ClusterSpec, plan: KernelPlan) -> None:
    every: list[str] = []
    for i, d in enumerate(plan.dcs):
        net = ipaddress.IPv4Network(d.subnet)
        assert net == ipaddress.IPv4Network(f"10.77.{i + 1}.0/24")
        assert d.control_address == f"10.77.{i + 1}.1"
        mine = [d.control_address, d.ns_address, *d.addresses()]
        assert all(ipaddress.IPv4Address(a) in net for a in mine)
        every += mine
        assert all(len(w) == d.connections for w in d.workers)
    assert len(set(every)) == len(every)


def test_connections_per_worker_are_the_most_of_any_link_touching_the_dc(spec: ClusterSpec, plan: KernelPlan) -> None:
    names = [dc.name for dc in spec.datacenters]
    for d in plan.dcs:
        others = [o for o in names if o != d.name]
        touching = [spec.link(d.name, o) for o in others] + [spec.link(o, d.name) for o in others]
        want = max(link.connections for link in touching)
        assert d.connections == want == 8


def test_one_leaf_per_worker_address_and_destination_with_the_capped_ceil(spec: ClusterSpec, plan: KernelPlan) -> None:
    names = [dc.name for dc in spec.datacenters]
    assert {(s.src, s.dst) for s in plan.links} == {(a, b) for a in names for b in names if a != b}
    for s in plan.links:
        bw, cap = link_rates(spec.link(s.src, s.dst))
        assert s.device == plan.dc(s.dst).host_if
        assert s.cls.rate_bytes_s == s.cls.ceil_bytes_s == bw
        per_address = [leaf for leaf in s.leaves if leaf.source.endswith("/32")]
        assert [leaf.source for leaf in per_address] == [f"{a}/32" for a in plan.dc(s.src).addresses()]
        # a connection whose listening end is in the destination DC is known by its destination
        by_destination = [leaf for leaf in s.leaves if leaf.destination is not None]
        assert [leaf.destination for leaf in by_destination] == [f"{a}/32" for a in plan.dc(s.dst).addresses()]
        assert {leaf.source for leaf in by_destination} == {plan.dc(s.src).subnet}
        rest = [leaf for leaf in s.leaves if leaf not in per_address and leaf not in by_destination]
        assert [(leaf.source, leaf.prio) for leaf in rest] == [(plan.dc(s.src).subnet, 2)]
        for leaf in s.leaves:
            assert leaf.cls.parent == s.cls.classid
            assert leaf.cls.ceil_bytes_s == min(bw, cap)
            assert leaf.cls.rate_bytes_s <= leaf.cls.ceil_bytes_s
        assert sum(leaf.cls.rate_bytes_s for leaf in s.leaves) <= bw  # guarantees never exceed the link


def test_a_connection_is_shaped_by_its_listening_address_in_either_direction() -> None:
    """Only gloo's listening end binds its per-connection address; the other sends from the
    namespace's primary address. Traffic towards a listener is matched by its destination."""
    p = plan_kernel_net(spec_of("demo.yaml"), "demo")
    listener = p.dc("dc-b").addresses()[3]
    into_b = " ".join(" ".join(c) for c in p.up_commands() if c[:3] == ["tc", "filter", "add"])
    assert f"match ip src {p.dc('dc-a').subnet} match ip dst {listener}/32" in into_b


def test_the_demo_link_numbers() -> None:
    """3.2768 Mbit/s, 5 ms one way, a 1 KiB window: a connection gets a quarter of the link."""
    p = plan_kernel_net(spec_of("demo.yaml"), "demo")
    s = p.link("dc-a", "dc-b")
    assert (s.bandwidth_bytes_s, s.conn_cap_bytes_s, s.leaf_ceil_bytes_s) == (409_600, 102_400, 102_400)
    up = [" ".join(c) for c in p.up_commands()]
    assert any(f"classid {s.cls.classid} htb rate 3276800bit ceil 3276800bit" in c for c in up)
    addresses = len(p.dc("dc-a").addresses()) + len(p.dc("dc-b").addresses())
    assert sum("ceil 819200bit" in c for c in up) == 2 * (addresses + 1)  # both links
    assert len(p.dc("dc-a").addresses()) == 2 * 8  # stage 0's two replicas, 8 connections each


def test_commands_are_consistent(plan: KernelPlan) -> None:
    up = plan.up_commands()
    assert all(c[0] in ("ip", "tc") for c in up + plan.down_commands())
    for d in plan.dcs:
        classes = {c[c.index("classid") + 1] for c in up if c[:3] == ["tc", "class", "add"] and d.host_if in c}
        flows = [c[c.index("flowid") + 1] for c in up if c[:3] == ["tc", "filter", "add"] and d.host_if in c]
        assert DEFAULT_CLASSID in classes
        assert flows and set(flows) <= classes
        parents = {c[c.index("parent") + 1] for c in up if c[:3] == ["tc", "class", "add"] and d.host_if in c}
        assert parents <= classes | {"1:"}
        # the namespace exists before anything is put in it, the qdisc before its classes
        first = [" ".join(c) for c in up].index(f"ip netns add {d.namespace}")
        assert all(i > first for i, c in enumerate(up) if d.namespace in c and c[:3] != ["ip", "netns", "add"])
    assert plan.down_commands()[0] == ["ip", "link", "del", "dev", plan.dcs[0].host_if]
    assert plan.netns_prefix(plan.dcs[1].name) == ["ip", "netns", "exec", plan.dcs[1].namespace]


def test_every_slot_has_its_own_worker(spec: ClusterSpec, plan: KernelPlan) -> None:
    pl = placement_of(spec)
    seen: dict[str, set[int]] = {d.name: set() for d in plan.dcs}
    for r in range(spec.parallelism.dp):
        for k in range(pl.stages):
            i = plan.local_index(spec, r, k)
            assert i not in seen[pl.stage_dc[k]]
            seen[pl.stage_dc[k]].add(i)
            assert len(plan.worker_addresses(pl.stage_dc[k], i)) == plan.dc(pl.stage_dc[k]).connections
    for d in plan.dcs:
        assert seen[d.name] == set(range(len(d.workers)))


def test_local_index_is_in_replica_then_stage_order() -> None:
    spec = parse_spec(
        {"datacenters": [{"name": "a", "gpus": 4}, {"name": "b", "gpus": 2}], "parallelism": {"pp": 3, "dp": 2}}
    )
    assert placement_of(spec).stage_dc == ("a", "a", "b")
    assert [local_index(spec, r, k) for r in range(2) for k in range(2)] == [0, 1, 2, 3]
    assert [local_index(spec, r, 2) for r in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="no slot"):
        local_index(spec, 2, 0)


def test_burst_formula_bounds() -> None:
    assert burst_bytes(102_400) == MIN_BURST  # tiny: one frame
    assert burst_bytes(1_250_000_000) == 1_250_000  # 10 Gbit/s: 1 ms of it
    assert burst_bytes(100) == 100 * MAX_BURST_S  # below ~6 kbit/s: 2 s, so tc's u32 time holds it
    for rate in (1, 100, 10_000, 409_600, 10**7, 10**9, 10**12):
        assert burst_bytes(rate) / rate <= MAX_BURST_S


def test_gso_packets_stay_short_on_slow_links() -> None:
    """htb charges a whole GSO packet at once: on the demo's 100 KB/s leaves one segment a packet,
    on a paper-scale link (10 Gbit/s, 6 MiB over 80 ms: 78.6 MB/s a connection) 1 ms worth."""
    demo = plan_kernel_net(spec_of("demo.yaml"), "r")
    assert [d.gso_max_segs for d in demo.dcs] == [1, 1]
    set_gso = [c for c in demo.up_commands() if "gso_max_segs" in c]
    assert [c[c.index("gso_max_segs") + 1] for c in set_gso] == ["1", "1"]
    assert gso_segments(78_643_200) == 51
    assert gso_segments(None) == 65535  # a DC with no WAN link


def test_a_dc_too_big_for_its_subnet_is_refused_or_capped() -> None:
    spec = parse_spec(
        {
            "datacenters": [{"name": "a", "gpus": 64}, {"name": "b", "gpus": 64}],
            "wan": {"default": {"connections": 8}},
            "parallelism": {"pp": 2, "dp": 64},
        }
    )
    with pytest.raises(ValueError, match="64 workers x 8 connections"):
        plan_kernel_net(spec, "big")
    p = plan_kernel_net(spec, "big", max_workers_per_dc=4)
    assert [len(d.workers) for d in p.dcs] == [4, 4]
    with pytest.raises(ValueError, match="no worker 4"):
        p.worker_addresses("a", 4)


def test_a_bad_base_is_refused() -> None:
    with pytest.raises(ValueError, match="two octets"):
        plan_kernel_net(spec_of("demo.yaml"), "r", base="10.300")
    assert plan_kernel_net(spec_of("demo.yaml"), "r", base="10.78").dcs[1].control_address == "10.78.2.1"


def test_forwarding_is_accepted_on_each_dcs_root_side_veth_and_removed_the_same_way(plan: KernelPlan) -> None:
    """A FORWARD policy of DROP (a Docker engine's) must not cut the DCs apart: one ACCEPT per DC,
    first in the chain, matched by the root-side veth the DC's traffic arrives on."""
    up, down = plan.forward_accept_commands(), plan.forward_remove_commands()
    assert up == [["iptables", "-I", "FORWARD", "1", "-i", d.host_if, "-j", "ACCEPT"] for d in plan.dcs]
    assert down == [["iptables", "-D", "FORWARD", "-i", d.host_if, "-j", "ACCEPT"] for d in plan.dcs]


def test_a_live_runs_addresses_come_from_its_run_id() -> None:
    """Every process of a run computes the same base from the run id; two runs rarely share one,
    and none is a base the kernel tests name (10.77-10.79)."""
    bases = {run_base(f"demo-fair-{pid}-1795744000") for pid in range(200)}
    assert run_base("r") == run_base("r") == f"10.{100 + int(run_tag('r'), 16) % 100}"
    assert all(100 <= int(b.split(".")[1]) <= 199 for b in bases) and len(bases) > 50
    plan = plan_kernel_net(spec_of("demo.yaml"), "r", base=run_base("r"))
    assert plan.dcs[0].control_address == f"{run_base('r')}.1.1"
