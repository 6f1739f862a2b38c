"""The kernel WAN's plan: network namespaces, addresses and htb shaping for a cluster spec.

`--wan kernel` turns each datacenter (DC) of the spec into a Linux network namespace, so the stage
workers of a DC talk to other DCs over real TCP through links shaped in the kernel, instead of
through the broker's emulation (`shared.policies.wan`). This module only *plans*: it is pure (no
I/O, no subprocess), so the plan can be unit-tested and printed; `bubbletea.launcher.kernel_wan`
runs its commands.

Topology. The root namespace is the control host (Redis, broker, dispatcher, front door) and the
router between DCs. DC i (its index in ``spec.datacenters``) gets namespace ``bt-<h>-<i>``, where
``<h>`` is a short hash of the run id so two runs never share a name, and a veth pair: the
root-side end ``bt<h><i>h`` holds ``<base>.<i+1>.1/24`` (the DC's *control address*: how its
workers reach Redis and the broker), the namespace end ``bt<h><i>n`` holds ``<base>.<i+1>.2/24``
(the source of traffic not bound to a worker address) and the worker addresses
``<base>.<i+1>.<10 + w*C + c>/24`` for each worker w of the DC and connection c < C, where C is the
most `connections` of any link touching the DC. A worker binds its c-th WAN connection to its c-th
address; that is what lets the root namespace tell connections apart and cap each one.

Shaping. There is no `netem` in our kernels, so latency cannot be added; what we shape is rate.
Traffic from DC i to DC j leaves the root namespace by DC j's root-side veth, and on that egress
sits an `htb` qdisc:

* class ``1:1`` (the default): unshaped (`DEFAULT_RATE_BPS`), for control traffic from the root
  namespace (Redis replies, deliveries) and anything unclassified (ARP);
* per source DC i, one class with rate = ceil = the bandwidth of link i -> j;
* under it, one leaf per source address of DC i (each worker address, plus a catch-all for the
  rest of i's /24), selected by a `u32` filter on the source address, with ceil = min(link
  bandwidth, per-connection cap). The cap, ``tcp_window_mib * MiB / (2 * latency)`` (as in
  `LinkModel.from_params`), stands in for the window / RTT limit a real WAN puts on one TCP
  connection; the leaf's guaranteed rate is the link's fair share among its leaves, so connections
  beyond the link share it equally (htb lends the parent's spare rate to leaves in equal quanta).

The namespace end of each veth sends GSO super-packets of at most 1 ms of the slowest leaf the
DC's traffic meets (`gso_max_segs`, see `gso_segments`): htb charges a packet's whole length when
it dequeues it, so a 64 KB GSO packet on a 100 KB/s class is 0.6 s of debt, and such a class sends
in bursts and pauses of that size (measured on a 100 KB/s class: 0 to 260 % of its rate over
0.25 s windows; with MTU-sized packets 98-105 %). Fast links keep big GSO packets: one segment per
packet costs so much CPU that htb then falls to half of a 2 Gbit/s link on our VMs.

Each leaf keeps htb's default queue, a pfifo as long as the veth's txqueuelen (1000 packets). A
short queue would bound the standing delay a bulk sender builds (no delay means TCP's window never
stops it: BBR keeps ~2 s queued at 100 KB/s), but the drops it causes stall TCP in recovery:
measured over 2 s, 8- to 32-packet leaf queues gave 54-107 % of the rate, erratically; 1000
packets gave 95.6 %, the header overhead below, every time.
Transfers that fit in a few windows (the demo's 8 KiB activations) never build such a queue.

Rates are whole bytes per second, handed to tc in bit/s (``<n>bit``). htb counts every packet's
length on the wire (Ethernet, IP and TCP headers included), so TCP goodput is about 4.4 % below a
class's rate at a 1500-byte MTU (1448 payload bytes in a 1514-byte frame): as on a real link.

Forwarding. The root namespace routes between the DCs, so the plan turns on ``ip_forward`` and
puts one ``iptables -I FORWARD 1 -i <root-side veth> -j ACCEPT`` per DC first in the FORWARD chain:
a host whose policy there is DROP (every host running a Docker engine) would otherwise route
nothing between the namespaces.

Concurrent runs on one host get distinct names from their run ids, but the addresses come from
`base`: give each concurrent run its own base (the executor refuses a base already in use). A
live run (the launchers and its workers) takes `run_base(run)`, one of 100 bases picked by the
run id's hash, so two runs at once (a demo beside a benchmark) rarely meet.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
from dataclasses import dataclass

from shared.config.spec import ClusterSpec, LinkParams
from shared.dataplane.htb import bits, burst_bytes, gso_segments, quantum_bytes
from shared.policies.pipeline_plan import placement_of

MIB = 1 << 20

#: Linux's limit on an interface name (IFNAMSIZ - 1).
IFNAME_MAX = 15
#: Hex digits of the run id's hash in every name: 16M values, so two runs rarely collide.
TAG_LEN = 6
#: First host number of the worker addresses in a DC's /24 (.1 = control, .2 = the namespace's own).
FIRST_WORKER_HOST = 10
LAST_HOST = 254

#: The default class's rate: control traffic is not meant to be shaped, 10 Gbit/s is "unshaped"
#: for what the control plane sends (Redis replies, deliveries).
DEFAULT_RATE_BPS = 10_000_000_000

HTB_HANDLE = "1:"
DEFAULT_CLASSID = "1:1"
#: First class minor number (hex in tc) of the per-source-DC classes and their leaves.
FIRST_MINOR = 0x10
MAX_MINOR = 0xFFFF

#: The sysctl the plan turns on in the root namespace (so it routes between the DCs); the
#: executor records the previous value and restores it when the plan comes down.
IP_FORWARD_KEY = "net.ipv4.ip_forward"
IP_FORWARD_PATH = "/proc/sys/net/ipv4/ip_forward"


def run_tag(run: str) -> str:
    """The short, stable hash of a run id that every name of the run carries."""
    return hashlib.sha256(run.encode("utf-8")).hexdigest()[:TAG_LEN]


#: `run_base` picks the second octet in [RUN_BASE_FIRST, RUN_BASE_FIRST + RUN_BASES): clear of
#: 10.77-10.79, which the kernel tests name themselves.
RUN_BASE_FIRST = 100
RUN_BASES = 100


def run_base(run: str) -> str:
    """The address base of a live run's plan, from its run id (every process of the run computes
    the same one): 10.100 to 10.199."""
    return f"10.{RUN_BASE_FIRST + int(run_tag(run), 16) % RUN_BASES}"


def link_rates(p: LinkParams) -> tuple[int, int]:
    """(link bandwidth, per-connection cap) of one directed link, in whole bytes/s (at least 1).

    The cap is ``tcp_window_mib * MiB / RTT`` (RTT = 2 x one-way latency), never above the link;
    a link with no latency has no window limit."""
    bw = p.bandwidth_gbps * 1e9 / 8
    rtt = 2 * p.latency_ms / 1000
    cap = p.tcp_window_mib * MIB / rtt if rtt > 0 else math.inf
    link = max(1, round(bw))
    return link, max(1, min(link, round(cap) if cap != math.inf else link))


@dataclass(frozen=True)
class DcNet:
    """One DC's namespace, veth pair and addresses."""

    name: str
    index: int
    namespace: str
    host_if: str  # root-side veth end
    ns_if: str  # namespace-side veth end
    subnet: str  # e.g. "10.77.1.0/24"
    control_address: str  # root-side address: Redis and the broker as seen from this DC
    ns_address: str  # the namespace's primary address: source of unbound traffic
    connections: int  # C: addresses per worker
    workers: tuple[tuple[str, ...], ...]  # workers[w][c], w = local index
    gso_max_segs: int  # on ns_if: see `gso_segments`

    def addresses(self) -> tuple[str, ...]:
        """Every worker address of the DC, worker by worker."""
        return tuple(a for w in self.workers for a in w)


@dataclass(frozen=True)
class HtbClass:
    classid: str
    parent: str
    rate_bytes_s: int
    ceil_bytes_s: int

    def command(self, device: str) -> list[str]:
        return [
            "tc", "class", "add", "dev", device, "parent", self.parent, "classid", self.classid,
            "htb", "rate", bits(self.rate_bytes_s), "ceil", bits(self.ceil_bytes_s),
            "burst", f"{burst_bytes(self.rate_bytes_s)}b", "cburst", f"{burst_bytes(self.ceil_bytes_s)}b",
            "quantum", str(quantum_bytes(self.rate_bytes_s)),
        ]  # fmt: skip


@dataclass(frozen=True)
class Leaf:
    """One htb leaf of a link: the traffic from `source` (an address /32, or the source DC's /24
    for the catch-all, matched with a lower priority), and to `destination` if given, into `cls`.

    Why leaves by destination too: of a data-plane connection's two ends only the listening one
    (gloo's rank 0, the earlier stage) is bound to its per-connection address; the connecting end
    sends from its namespace's primary address. So a connection is known by its listening address:
    as the source when the listener is in the source DC, as the destination when it is in the
    destination DC (traffic from the source DC's /24 to that address)."""

    source: str
    prio: int
    cls: HtbClass
    destination: str | None = None

    def filter_command(self, device: str) -> list[str]:
        dst = ["match", "ip", "dst", self.destination] if self.destination else []
        return [
            "tc", "filter", "add", "dev", device, "parent", HTB_HANDLE, "protocol", "ip", "prio", str(self.prio),
            "u32", "match", "ip", "src", self.source, *dst, "flowid", self.cls.classid,
        ]  # fmt: skip


@dataclass(frozen=True)
class LinkShaping:
    """The directed link src -> dst: a class on dst's root-side veth and a leaf per source address."""

    src: str
    dst: str
    device: str  # dst's root-side veth: where src -> dst traffic leaves the root namespace
    bandwidth_bytes_s: int
    conn_cap_bytes_s: int
    cls: HtbClass
    leaves: tuple[Leaf, ...]

    @property
    def leaf_ceil_bytes_s(self) -> int:
        return min(self.bandwidth_bytes_s, self.conn_cap_bytes_s)


def local_index(spec: ClusterSpec, replica: int, stage: int) -> int:
    """The slot (replica, stage)'s index among the slots of its DC, in (replica, stage) order: the
    worker of that slot uses `KernelPlan.worker_addresses(dc, local_index)`."""
    pl = placement_of(spec)
    if not (0 <= replica < spec.parallelism.dp and 0 <= stage < pl.stages):
        raise ValueError(f"no slot (replica={replica}, stage={stage}) in DP={spec.parallelism.dp} x PP={pl.stages}")
    dc = pl.stage_dc[stage]
    slots = [(r, k) for r in range(spec.parallelism.dp) for k in range(pl.stages) if pl.stage_dc[k] == dc]
    return slots.index((replica, stage))


@dataclass(frozen=True)
class KernelPlan:
    run: str
    tag: str
    base: str
    dcs: tuple[DcNet, ...]
    links: tuple[LinkShaping, ...]
    #: Sysctls set in the root namespace while the plan is up, as (key, /proc path, value); the
    #: executor saves each previous value and restores it on the way down.
    sysctls: tuple[tuple[str, str, str], ...] = ((IP_FORWARD_KEY, IP_FORWARD_PATH, "1"),)

    local_index = staticmethod(local_index)

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(d.namespace for d in self.dcs)

    @property
    def interfaces(self) -> tuple[str, ...]:
        """Every interface name of the plan (root side then namespace side, per DC)."""
        return tuple(n for d in self.dcs for n in (d.host_if, d.ns_if))

    def dc(self, name: str) -> DcNet:
        for d in self.dcs:
            if d.name == name:
                return d
        raise KeyError(f"no datacenter {name!r} in the kernel WAN plan (known: {', '.join(x.name for x in self.dcs)})")

    def control_address(self, dc_name: str) -> str:
        return self.dc(dc_name).control_address

    def worker_addresses(self, dc_name: str, local_index: int) -> list[str]:
        """The C source addresses of the DC's worker `local_index`, one per connection index."""
        d = self.dc(dc_name)
        if not 0 <= local_index < len(d.workers):
            raise ValueError(f"{dc_name}: no worker {local_index} in the plan (it has {len(d.workers)})")
        return list(d.workers[local_index])

    def netns_prefix(self, dc_name: str) -> list[str]:
        """argv prefix that runs a command inside the DC's namespace."""
        return ["ip", "netns", "exec", self.dc(dc_name).namespace]

    def link(self, src: str, dst: str) -> LinkShaping:
        for s in self.links:
            if (s.src, s.dst) == (src, dst):
                return s
        raise KeyError(f"no link {src} -> {dst} in the kernel WAN plan")

    def up_commands(self) -> list[list[str]]:
        """`ip` and `tc` commands that build the plan, in order (the sysctls are the executor's)."""
        cmds: list[list[str]] = []
        for d in self.dcs:
            ns = ["ip", "-n", d.namespace]
            cmds += [
                ["ip", "netns", "add", d.namespace],
                ["ip", "link", "add", d.host_if, "type", "veth", "peer", "name", d.ns_if, "netns", d.namespace],
                ["ip", "addr", "add", f"{d.control_address}/24", "dev", d.host_if],
                # htb gives each leaf a pfifo as long as this queue (module docstring): say it, not trust it
                ["ip", "link", "set", "dev", d.host_if, "txqueuelen", "1000", "up"],
                [*ns, "link", "set", "dev", "lo", "up"],
                # first address of the /24 on the device = the primary, the source of unbound sockets
                [*ns, "addr", "add", f"{d.ns_address}/24", "dev", d.ns_if],
                *([*ns, "addr", "add", f"{a}/24", "dev", d.ns_if] for a in d.addresses()),
                # GSO packets no longer than 1 ms of the slowest leaf: htb shapes them smoothly (module docstring)
                [*ns, "link", "set", "dev", d.ns_if, "gso_max_segs", str(d.gso_max_segs), "up"],
                [*ns, "route", "add", "default", "via", d.control_address],
            ]
        for d in self.dcs:
            cmds += [
                ["tc", "qdisc", "add", "dev", d.host_if, "root", "handle", HTB_HANDLE, "htb", "default", "1"],
                HtbClass(DEFAULT_CLASSID, HTB_HANDLE, DEFAULT_RATE_BPS // 8, DEFAULT_RATE_BPS // 8).command(d.host_if),
            ]
            for s in self.links:
                if s.device == d.host_if:
                    cmds.append(s.cls.command(s.device))
                    cmds += [leaf.cls.command(s.device) for leaf in s.leaves]
                    cmds += [leaf.filter_command(s.device) for leaf in s.leaves]
        return cmds

    def forward_accept_commands(self) -> list[list[str]]:
        """iptables rules that let the root namespace forward the plan's traffic: one per DC, on the
        DC's root-side veth, first in FORWARD. A host whose FORWARD policy drops (a Docker engine
        sets DROP) would otherwise route nothing between the DCs; on an accepting host they change
        nothing. The executor adds them only where `iptables` exists."""
        return [["iptables", "-I", "FORWARD", "1", "-i", d.host_if, "-j", "ACCEPT"] for d in self.dcs]

    def forward_remove_commands(self) -> list[list[str]]:
        """The rules of `forward_accept_commands`, deleted (a rule that is gone is fine)."""
        return [["iptables", "-D", "FORWARD", "-i", d.host_if, "-j", "ACCEPT"] for d in self.dcs]

    def down_commands(self) -> list[list[str]]:
        """Commands that remove the plan, in order. Deleting a veth end removes its peer and every
        qdisc on both; deleting the namespace's name drops the rest. The executor tolerates
        objects already gone (a half-built or crashed plan)."""
        cmds: list[list[str]] = []
        for d in self.dcs:
            cmds += [["ip", "link", "del", "dev", d.host_if], ["ip", "netns", "del", d.namespace]]
        return cmds


def _workers_per_dc(spec: ClusterSpec) -> dict[str, int]:
    pl = placement_of(spec)
    count = {dc.name: 0 for dc in spec.datacenters}
    for k in range(pl.stages):
        count[pl.stage_dc[k]] += spec.parallelism.dp
    return count


def plan_kernel_net(
    spec: ClusterSpec, run: str, base: str = "10.77", max_workers_per_dc: int | None = None
) -> KernelPlan:
    """Plan namespaces, addresses and shaping for `spec` (see the module docstring).

    `base` is the first two octets of the addresses. `max_workers_per_dc` caps how many workers
    of a DC get addresses (None: one per (replica, stage) slot placed there), e.g. to keep a big
    spec's plan inside a /24; the plan raises `ValueError` if the addresses still do not fit."""
    try:
        net16 = ipaddress.IPv4Network(f"{base}.0.0/16")
    except ValueError:
        raise ValueError(f"base must be two octets such as '10.77', got {base!r}") from None
    if len(spec.datacenters) > 255:
        raise ValueError(f"a kernel WAN holds at most 255 datacenters (one /24 of {net16} each)")
    if max_workers_per_dc is not None and max_workers_per_dc < 0:
        raise ValueError(f"max_workers_per_dc must be >= 0, got {max_workers_per_dc}")
    tag = run_tag(run)
    names = [dc.name for dc in spec.datacenters]
    slots = _workers_per_dc(spec)

    dcs: list[DcNet] = []
    for i, name in enumerate(names):
        conns = max([spec.link(name, o).connections for o in names if o != name]
                    + [spec.link(o, name).connections for o in names if o != name] + [1])  # fmt: skip
        n_workers = slots[name] if max_workers_per_dc is None else min(slots[name], max_workers_per_dc)
        if FIRST_WORKER_HOST + n_workers * conns - 1 > LAST_HOST:
            raise ValueError(
                f"datacenter {name!r}: {n_workers} workers x {conns} connections need {n_workers * conns} addresses, "
                f"but its /24 holds {LAST_HOST - FIRST_WORKER_HOST + 1}; lower the links' connections or pass "
                "max_workers_per_dc"
            )
        prefix = f"{base}.{i + 1}"
        host_if, ns_if = f"bt{tag}{i}h", f"bt{tag}{i}n"
        for ifname in (host_if, ns_if):
            assert len(ifname) <= IFNAME_MAX, f"interface name {ifname!r} is longer than {IFNAME_MAX}"
        workers = tuple(
            tuple(f"{prefix}.{FIRST_WORKER_HOST + w * conns + c}" for c in range(conns)) for w in range(n_workers)
        )
        ceils = [min(link_rates(spec.link(name, o))) for o in names if o != name]
        dcs.append(
            DcNet(
                name=name,
                index=i,
                namespace=f"bt-{tag}-{i}",
                host_if=host_if,
                ns_if=ns_if,
                subnet=f"{prefix}.0/24",
                control_address=f"{prefix}.1",
                ns_address=f"{prefix}.2",
                connections=conns,
                workers=workers,
                gso_max_segs=gso_segments(min(ceils, default=None)),
            )
        )

    links: list[LinkShaping] = []
    for dst in dcs:
        minor = FIRST_MINOR
        for src in dcs:
            if src is dst:
                continue
            bw, cap = link_rates(spec.link(src.name, dst.name))
            cls = HtbClass(f"1:{minor:x}", HTB_HANDLE, bw, bw)
            sources: list[tuple[str, int, str | None]] = [(f"{a}/32", 1, None) for a in src.addresses()]
            sources += [(src.subnet, 1, f"{a}/32") for a in dst.addresses()]  # listeners in dst (Leaf)
            sources += [(src.subnet, 2, None)]
            share = max(1, min(bw, cap, bw // len(sources)))  # guaranteed: the link's fair share
            leaves = tuple(
                Leaf(source, prio, HtbClass(f"1:{minor + 1 + n:x}", cls.classid, share, min(bw, cap)), dest)
                for n, (source, prio, dest) in enumerate(sources)
            )
            minor += 1 + len(leaves)
            if minor - 1 > MAX_MINOR:
                raise ValueError(f"datacenter {dst.name!r}: more htb classes than tc's 16-bit class ids hold")
            links.append(LinkShaping(src.name, dst.name, dst.host_if, bw, cap, cls, leaves))
    return KernelPlan(run=run, tag=tag, base=base, dcs=tuple(dcs), links=tuple(links))
