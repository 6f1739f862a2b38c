"""Exact timelines of transfers over real sockets under the slot protocol (`SocketWan`): 100 B/s
links, the protocol's hops 0.1 s (request), 0.2 s (grant + announcement), 0.05 s (report)."""

from collections.abc import Hashable

import pytest

from shared.policies.socket_wan import SocketWan
from shared.policies.wan import LinkModel, Sent, SlotControl

HOPS = SlotControl(request_s=0.1, start_s=0.2, report_s=0.05)
AB, BA = ("a", "b"), ("b", "a")


def link(flow_cap: float = 100.0, latency: float = 0.0, overhead: float = 1.0) -> LinkModel:
    return LinkModel(bandwidth=100.0, latency=latency, flow_cap=flow_cap, overhead=overhead, control=HOPS)


Send = tuple[str, tuple[str, str], Hashable, int, tuple[int, ...], float]  # id, link, pair, bytes, priority, time


def run(sends: list[Send], policy: str = "temporal", model: LinkModel | None = None) -> dict[str, tuple[float, ...]]:
    """Send in time order, then drain; each transfer's (first byte, last byte, arrival)."""
    m = model or link()
    wan = SocketWan({AB: m, BA: m}, policy)
    out: dict[str, Sent] = {}
    for tid, lk, pair, nbytes, prio, t in sends:
        for s in wan.advance(t):
            out[s.id] = s
        wan.send(tid, lk, pair, nbytes, prio, t)
    while (t := wan.next_time()) is not None:
        for s in wan.advance(t):
            out[s.id] = s
    assert wan.in_flight() == 0
    return {k: (round(v.started, 9), round(v.tx_end, 9), round(v.arrival, 9)) for k, v in sorted(out.items())}


def test_one_transfer_waits_for_its_request_and_its_start() -> None:
    # request at 0.1 (granted: the link is free), bytes from 0.3 (grant + announcement), 1 s of them
    for policy in ("fair", "temporal", "fifo"):
        assert run([("x", AB, 0, 100, (0,), 0.0)], policy) == {"x": (0.3, 1.3, 1.3)}


def test_headers_and_latency_lengthen_it() -> None:
    # 1.25 wire bytes per payload byte: 1.25 s on the wire; a 0.5 s latency: the ready notice
    # crosses before the first byte (0.3 + 0.5), the last byte after it (2.05 + 0.5)
    assert run([("x", AB, 0, 100, (0,), 0.0)], model=link(overhead=1.25)) == {"x": (0.3, 1.55, 1.55)}
    assert run([("x", AB, 0, 100, (0,), 0.0)], model=link(latency=0.5)) == {"x": (0.8, 1.8, 2.3)}


def test_temporal_grants_the_next_once_the_last_is_reported() -> None:
    # x lands at 1.3, its report frees the link at 1.35, y is granted then and starts 0.2 later:
    # the link idles for the report and the start (0.25 s) between two transfers
    two = [("x", AB, 0, 100, (0,), 0.0), ("y", AB, 1, 100, (1,), 0.0)]
    assert run(two, "temporal") == {"x": (0.3, 1.3, 1.3), "y": (1.55, 2.55, 2.55)}
    # fair grants both at once; two pairs share the link: 200 B at 100 B/s
    assert run(two, "fair") == {"x": (0.3, 2.3, 2.3), "y": (0.3, 2.3, 2.3)}


def test_one_pair_sends_in_order_on_its_connections() -> None:
    # the same pair and direction: y's bytes follow x's on the same connections, no sharing
    same = [("x", AB, 0, 100, (0,), 0.0), ("y", AB, 0, 100, (1,), 0.0)]
    assert run(same, "fair") == {"x": (0.3, 1.3, 1.3), "y": (1.3, 2.3, 2.3)}


def test_the_ready_notice_waits_behind_the_reverse_bytes_of_the_pair() -> None:
    # x (a->b) is on the wire 0.3-1.3; y (b->a, same pair) is granted at 0.6 and its receive posted
    # at 0.8, but the notice travels a->b behind x's bytes: y starts when x's last byte is out
    both = [("x", AB, 0, 100, (0,), 0.0), ("y", BA, 0, 100, (0,), 0.5)]
    assert run(both) == {"x": (0.3, 1.3, 1.3), "y": (1.3, 2.3, 2.3)}
    # another pair's connections carry no x: y starts at once
    other = [("x", AB, 0, 100, (0,), 0.0), ("y", BA, 1, 100, (0,), 0.5)]
    assert run(other) == {"x": (0.3, 1.3, 1.3), "y": (0.8, 1.8, 1.8)}


def test_temporal_is_work_conserving_with_window_capped_transfers() -> None:
    # one transfer reaches a quarter of the link: the arbiter grants four at once, each at 25 B/s
    four = [(f"t{i}", AB, i, 100, (i,), 0.0) for i in range(4)]
    assert run(four, "temporal", link(flow_cap=25.0)) == {f"t{i}": (0.3, 4.3, 4.3) for i in range(4)}
    # a fifth waits for the first report (4.35) and starts 0.2 later, alone at its cap
    five = [*four, ("t4", AB, 4, 100, (4,), 0.0)]
    assert run(five, "temporal", link(flow_cap=25.0))["t4"] == (4.55, 8.55, 8.55)


def test_misuse_is_refused() -> None:
    wan = SocketWan({AB: link()})
    wan.send("x", AB, 0, 100, (0,), 1.0)
    with pytest.raises(ValueError, match="already under way"):
        wan.send("x", AB, 0, 100, (0,), 1.0)
    with pytest.raises(ValueError, match="backwards"):
        wan.advance(0.5)
    with pytest.raises(ValueError, match="no slot protocol"):
        SocketWan({AB: LinkModel(100.0, 0.0, 100.0)})
