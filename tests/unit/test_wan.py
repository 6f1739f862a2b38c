"""Exact timelines of the link-sharing policies on small cases (bandwidth 100 B/s, latency 1 s)."""

import math

import pytest

from shared.config.spec import LinkParams
from shared.policies.wan import (
    BUS_HOP_S,
    HEADER_OVERHEAD,
    MIB,
    LinkModel,
    LinkSharing,
    Sent,
    SlotControl,
)

LINK = LinkModel(bandwidth=100.0, latency=1.0, flow_cap=100.0)


def run(
    policy: str, transfers: list[tuple[str, int, tuple[int, ...], float]], model: LinkModel = LINK
) -> dict[str, Sent]:
    """Submit (id, bytes, priority, time) in time order, then drain; returns each transfer's record."""
    link = LinkSharing(model, policy)
    out: dict[str, Sent] = {}
    for tid, nbytes, prio, t in transfers:
        for s in link.advance(t):
            out[s.id] = s
        link.submit(tid, nbytes, prio, t)
    while (t := link.next_tx_end()) is not None:
        for s in link.advance(t):
            out[s.id] = s
    for s in link.advance(link.now):
        out[s.id] = s
    assert link.in_flight() == 0
    return out


def ends(out: dict[str, Sent]) -> dict[str, tuple[float, float, float]]:
    return {k: (round(v.started, 9), round(v.tx_end, 9), round(v.arrival, 9)) for k, v in sorted(out.items())}


@pytest.mark.parametrize("policy", ["fair", "temporal", "fifo"])
def test_one_transfer_alone(policy: str) -> None:
    assert ends(run(policy, [("a", 100, (0,), 0.0)])) == {"a": (0.0, 1.0, 2.0)}


def test_two_transfers() -> None:
    both = [("a", 100, (0,), 0.0), ("b", 100, (1,), 0.0)]
    assert ends(run("fair", both)) == {"a": (0.0, 2.0, 3.0), "b": (0.0, 2.0, 3.0)}
    assert ends(run("temporal", both)) == {"a": (0.0, 1.0, 2.0), "b": (1.0, 2.0, 3.0)}


def test_four_transfers_fair_vs_temporal_vs_fifo() -> None:
    # submitted in reverse priority order at the same instant
    four = [(f"t{i}", 100, (3 - i,), 0.0) for i in range(4)]
    assert {v[1] for v in ends(run("fair", four)).values()} == {4.0}
    temporal = ends(run("temporal", four))
    assert [temporal[f"t{i}"][1] for i in (3, 2, 1, 0)] == [1.0, 2.0, 3.0, 4.0]  # by priority
    fifo = ends(run("fifo", four))
    assert [fifo[f"t{i}"][1] for i in range(4)] == [1.0, 2.0, 3.0, 4.0]  # by submission


def test_started_transfer_is_not_preempted() -> None:
    out = ends(run("temporal", [("low", 100, (9,), 0.0), ("high", 100, (0,), 0.5)]))
    assert out == {"low": (0.0, 1.0, 2.0), "high": (1.0, 2.0, 3.0)}


def test_fair_rates_change_on_arrival_and_departure() -> None:
    # a alone for 0.5 s (50 B), then shares: 50 B left at 50 B/s -> ends 1.5; b then alone
    out = ends(run("fair", [("a", 100, (0,), 0.0), ("b", 100, (0,), 0.5)]))
    assert out == {"a": (0.0, 1.5, 2.5), "b": (0.5, 2.0, 3.0)}


def test_window_capped_flows() -> None:
    capped = LinkModel(bandwidth=100.0, latency=1.0, flow_cap=25.0)
    assert ends(run("fair", [("a", 100, (0,), 0.0)], capped)) == {"a": (0.0, 4.0, 5.0)}
    two = [("a", 100, (0,), 0.0), ("b", 100, (1,), 0.0)]
    # a single flow cannot fill the link: temporal is work-conserving and runs both at the cap
    assert (
        ends(run("fair", two, capped))
        == ends(run("temporal", two, capped))
        == {"a": (0.0, 4.0, 5.0), "b": (0.0, 4.0, 5.0)}
    )
    four = [(f"t{i}", 100, (i,), 0.0) for i in range(4)]
    fair = ends(run("fair", four, LinkModel(100.0, 1.0, 40.0)))
    assert {v[1] for v in fair.values()} == {4.0}
    temporal = ends(run("temporal", four, LinkModel(100.0, 1.0, 40.0)))
    # t0, t1 at 40 B/s; t2 at the remaining 20; at 2.5 t0/t1 are done, t2 (50 left) and t3 run at 40
    assert temporal == {"t0": (0.0, 2.5, 3.5), "t1": (0.0, 2.5, 3.5), "t2": (0.0, 3.75, 4.75), "t3": (2.5, 5.0, 6.0)}


def test_link_model_from_params() -> None:
    m = LinkModel.from_params(LinkParams(latency_ms=40, bandwidth_gbps=10, tcp_window_mib=6, connections=1))
    assert m.bandwidth == 10e9 / 8 and m.latency == 0.04
    assert math.isclose(m.flow_cap, 6 * MIB / 0.08)  # ~1.3 Gb/s for one 6 MiB window on a 40 ms path
    many = LinkModel.from_params(LinkParams(latency_ms=40, bandwidth_gbps=10, tcp_window_mib=6, connections=16))
    assert many.flow_cap == many.bandwidth  # enough connections fill the link
    assert LinkModel.from_params(LinkParams(latency_ms=0)).flow_cap == 10e9 / 8


def test_each_wan_mode_realises_the_link_its_own_way() -> None:
    p = LinkParams(latency_ms=5, bandwidth_gbps=0.0524288, tcp_window_mib=0.00390625, connections=1)
    model = LinkModel.from_params(p, "model")
    assert model == LinkModel.from_params(p)  # the default: what the broker emulates, unchanged
    assert (model.bandwidth, model.latency, model.flow_cap) == (6_553_600.0, 0.005, 409_600.0)
    assert model.overhead == 1.0 and model.control is None
    kernel = LinkModel.from_params(p, "kernel")
    # htb charges 1514 wire bytes per 1448 payload bytes; no netem, so no delay, but the spec's
    # latency still sets the per-connection cap (4 KiB window / 10 ms RTT)
    assert HEADER_OVERHEAD == 1514 / 1448
    assert (kernel.bandwidth, kernel.latency, kernel.flow_cap, kernel.overhead) == (
        6_553_600.0,
        0.0,
        409_600.0,
        1514 / 1448,
    )
    # the slot protocol: a bus hop to request, two (grant, announcement) to start, one to report
    assert BUS_HOP_S == 0.00034
    assert kernel.control == SlotControl(request_s=0.00034, start_s=0.00068, report_s=0.00034)
    none = LinkModel.from_params(p, "none")
    assert none.latency == 0.005 and none.overhead == kernel.overhead and none.control == kernel.control
    with pytest.raises(ValueError, match="unknown WAN mode"):
        LinkModel.from_params(p, "tunnel")


def test_headers_lengthen_every_transfer_by_the_overhead() -> None:
    # 100 payload bytes at 1.25 wire bytes each on a 100 B/s link: 1.25 s, then 1 s of latency
    framed = LinkModel(bandwidth=100.0, latency=1.0, flow_cap=100.0, overhead=1.25)
    assert (framed.payload_bandwidth, framed.payload_cap) == (80.0, 80.0)
    for policy in ("fair", "temporal", "fifo"):
        assert ends(run(policy, [("a", 100, (0,), 0.0)], framed)) == {"a": (0.0, 1.25, 2.25)}
    two = [("a", 100, (0,), 0.0), ("b", 100, (1,), 0.0)]
    assert ends(run("fair", two, framed)) == {"a": (0.0, 2.5, 3.5), "b": (0.0, 2.5, 3.5)}
    assert ends(run("temporal", two, framed)) == {"a": (0.0, 1.25, 2.25), "b": (1.25, 2.5, 3.5)}
    assert framed.alone_s(100) == 2.25
    # with the slot protocol, a transfer alone also waits for its request and its start
    granted = LinkModel(100.0, 1.0, 100.0, overhead=1.25, control=SlotControl(0.5, 0.25, 0.125))
    assert granted.alone_s(100) == 0.5 + 0.25 + 1.25 + 1.0


def test_utilization_stats_and_zero_bytes() -> None:
    link = LinkSharing(LINK, "temporal")
    link.submit("z", 0, (0,), 0.0)
    assert [s.tx_end for s in link.advance(0.0)] == [0.0]
    link.submit("a", 100, (0,), 1.0)
    link.advance(5.0)
    assert link.stats.bytes_sent == pytest.approx(100) and link.stats.busy_s == pytest.approx(1.0)
    assert link.stats.transfers == 2


def test_misuse_is_refused() -> None:
    link = LinkSharing(LINK, "fair")
    link.submit("a", 10, (0,), 1.0)
    with pytest.raises(ValueError, match="already on this link"):
        link.submit("a", 10, (0,), 1.0)
    with pytest.raises(ValueError, match="backwards"):
        link.advance(0.5)
    with pytest.raises(ValueError, match="unknown sharing policy"):
        LinkSharing(LINK, "greedy")


def test_large_transfers_far_from_time_zero_terminate() -> None:
    """Regression: at t ~ 15 s a 33 MB transfer's last crumb lasts less than the clock's resolution."""
    link = LinkSharing(LinkModel.from_params(LinkParams(latency_ms=40, bandwidth_gbps=10, connections=8)), "fair")
    t = 15.705792458087393
    for i in range(8):
        link.submit(f"a{i}", 33_554_432, (i,), t + i * 1e-3)
    done: list[Sent] = []
    while (nxt := link.next_tx_end()) is not None:
        done += link.advance(nxt)
    assert len(done) == 8 and link.in_flight() == 0
