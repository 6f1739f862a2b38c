"""A host of our own that can be lost without a word: a network namespace on a veth pair whose
packets can all be dropped (`bench/faults.py`, arm `lost-host`).

A process killed on a live host has its sockets closed by the kernel: its peers and Redis see a
FIN or a reset at once. A host that loses power, or whose switch port dies, sends nothing: its
connections stay open on every other machine until a timeout says otherwise. This is that host:
a stage worker started inside the namespace (`prefix`) reaches Redis and its peers over the veth,
and `cut` routes the other end's address into a blackhole on both sides, so nothing it sends
arrives and nothing sent to it arrives; no FIN, no reset: the connections stay open at both ends
until TCP gives up (many minutes). A send on a blackholed route fails at once on the sending host
(the kernel's EINVAL, which TCP takes as a soft error and retries), where a real lost host's peer
would wait for acknowledgements: the same to every peer but the host itself. (A tc drop filter
would be closer still, but this kernel has no tc actions: `action drop` fails to load.) `restore`
removes the blackholes; `remove` deletes the namespace (and so the veth).

Addresses: 10.254.N.0/30 (`.1` the root end, `.2` the namespace), away from the kernel WAN's
10.100-10.199 (`shared/dataplane/kernel_net.py`). Needs root and iproute2's `ip` (checked by `usable`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def usable() -> str | None:
    """None where a host can be built here, else why not (one line)."""
    if os.geteuid() != 0:
        return "not root (network namespaces need it)"
    if not shutil.which("ip"):
        return "no iproute2 (ip)"
    return None


@dataclass(frozen=True)
class LostHost:
    """Host number `n` (0-255): its namespace, veth ends and addresses."""

    n: int
    tag: str

    @property
    def namespace(self) -> str:
        return f"btlost-{self.tag}-{self.n}"

    @property
    def root_if(self) -> str:
        return f"btl{self.tag[:4]}{self.n}r"

    @property
    def ns_if(self) -> str:
        return f"btl{self.tag[:4]}{self.n}n"

    @property
    def root_address(self) -> str:
        """This machine's end: where Redis and the other workers are reached from the host."""
        return f"10.254.{self.n}.1"

    @property
    def address(self) -> str:
        """The host's own address (its worker binds its groups there: BUBBLETEA_PLANE_HOST)."""
        return f"10.254.{self.n}.2"

    @property
    def prefix(self) -> tuple[str, ...]:
        """The command prefix that starts a process on the host."""
        return ("ip", "netns", "exec", self.namespace)

    def build(self) -> LostHost:
        self.remove()  # a leftover of a killed bench
        _ip("ip", "netns", "add", self.namespace)
        _ip("ip", "link", "add", self.root_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("ip", "link", "set", self.ns_if, "netns", self.namespace)
        _ip("ip", "addr", "add", f"{self.root_address}/30", "dev", self.root_if)
        _ip("ip", "link", "set", self.root_if, "up")
        inside = self.prefix
        _ip(*inside, "ip", "addr", "add", f"{self.address}/30", "dev", self.ns_if)
        _ip(*inside, "ip", "link", "set", self.ns_if, "up")
        _ip(*inside, "ip", "link", "set", "lo", "up")
        return self

    def cut(self) -> None:
        """Nothing sent either way arrives: a blackhole route for the other end's address on each
        side (more specific than the link's /30), so no packet leaves either end, ARP included."""
        _ip("ip", "route", "add", "blackhole", f"{self.address}/32")
        _ip(*self.prefix, "ip", "route", "add", "blackhole", f"{self.root_address}/32")

    def restore(self) -> None:
        """The host reachable again (the blackholes gone), for the next fault."""
        _ip("ip", "route", "del", "blackhole", f"{self.address}/32", check=False)
        _ip(*self.prefix, "ip", "route", "del", "blackhole", f"{self.root_address}/32", check=False)

    def remove(self) -> None:
        """The namespace and its veth gone (its processes must be stopped first); fine if absent."""
        self.restore()
        _ip("ip", "link", "del", self.root_if, check=False)
        _ip("ip", "netns", "del", self.namespace, check=False)
