"""`--wan kernel`: bring a `KernelPlan` (shared/dataplane/kernel_net.py) up in the kernel and down again.

The plan is pure; this module runs it: `check_privileges` says in one line why a machine cannot
(not root, no iproute2, no namespaces, no veth/htb/u32), `default_wan_mode` picks `kernel` where
it can run and `model` elsewhere (for the launchers whose default it is), and
``async with kernel_wan(plan):``
builds the namespaces, veths, addresses and htb shaping, turns on IPv4 forwarding in the root
namespace (it routes between the DCs) and, where iptables exists, accepts the DCs' forwarded traffic
first in FORWARD (a Docker engine sets that chain's policy to DROP), and removes everything and
restores forwarding on the way out, whether the body returns, raises or is cancelled (Ctrl-C
cancels the launcher's main task).

Crash safety. Leftovers of the same plan (same run id: a run that was killed) are removed before
anything is built, so a rerun starts clean. The value ip_forward had before the first kernel-WAN
run is kept in a small file per run under /run/bubbletea (tmpfs, so it goes at reboot with the
namespaces): a rerun after a crash restores the true original rather than the 1 the crashed run
left, and of several runs at once only the last one out restores it. `teardown` is the same clean-up,
synchronous, for atexit or a signal handler; `kernel_wan` registers it with atexit while up.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import ipaddress
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from shared.dataplane.kernel_net import IP_FORWARD_PATH, KernelPlan
from shared.runtime.logs import get_logger

log = get_logger(__name__)

#: Where each run keeps the original values of the sysctls it changed.
STATE_DIR = Path("/run/bubbletea")

#: stderr of a command whose object is already gone: fine on the way down.
_MISSING = ("Cannot find device", "No such file or directory", "does not exist", "Bad rule")

_ADVICE = "run as root, or use --wan model"


class KernelWanError(RuntimeError):
    """The kernel WAN cannot be built or used here; the message is one line that says why, and
    `reason` the same in a few words (e.g. "not root"), for a launcher that falls back."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _run_sync(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)


# --- privileges --------------------------------------------------------------------------------


def check_privileges() -> None:
    """Raise `KernelWanError` (one line) unless this process can build a kernel WAN.

    Tries the real thing on a throwaway namespace: create it, a veth pair inside, an htb qdisc and
    a u32 filter on it, then delete it. Being root is not enough in a container without
    CAP_NET_ADMIN and CAP_SYS_ADMIN, and a kernel may lack the veth, htb or u32 modules."""
    if os.geteuid() != 0:
        raise KernelWanError(
            f"--wan kernel needs root (CAP_NET_ADMIN) to create network namespaces and shape links "
            f"(running as uid {os.geteuid()}); {_ADVICE}",
            reason=f"not root (uid {os.geteuid()})",
        )
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise KernelWanError(
            f"--wan kernel needs the iproute2 tools `ip` and `tc` ({' and '.join(missing)} not found on PATH); "
            "install iproute2, or use --wan model",
            reason=f"no iproute2 ({' and '.join(missing)} not on PATH)",
        )
    probe = f"bt-probe-{os.getpid()}"
    ns = ["ip", "-n", probe]
    steps = [
        ["ip", "netns", "add", probe],
        [*ns, "link", "add", "btp0", "type", "veth", "peer", "name", "btp1"],
        [*ns, "link", "set", "dev", "btp0", "up"],
        ["tc", "-n", probe, "qdisc", "add", "dev", "btp0", "root", "handle", "1:", "htb", "default", "1"],
        ["tc", "-n", probe, "class", "add", "dev", "btp0", "parent", "1:", "classid", "1:1", "htb", "rate", "8mbit"],
        ["tc", "-n", probe, "filter", "add", "dev", "btp0", "parent", "1:", "protocol", "ip", "prio", "1",
         "u32", "match", "ip", "src", "10.0.0.1/32", "flowid", "1:1"],
    ]  # fmt: skip
    try:
        for i, cmd in enumerate(steps):
            r = _run_sync(cmd)
            if r.returncode != 0:
                why = _one_line(r.stderr) or f"exit status {r.returncode}"
                if i == 0:
                    raise KernelWanError(
                        f"--wan kernel needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces "
                        f"and shape links (`ip netns add` failed: {why}); {_ADVICE}",
                        reason=f"no network namespaces (`ip netns add` failed: {why})",
                    )
                raise KernelWanError(
                    f"--wan kernel needs veth pairs and the htb qdisc with u32 filters in the kernel "
                    f"(`{shlex.join(cmd)}` failed: {why}); use --wan model",
                    reason=f"no veth / htb / u32 in the kernel (`{shlex.join(cmd[:5])} ...` failed)",
                )
    finally:
        _run_sync(["ip", "netns", "del", probe])


def default_wan_mode() -> tuple[str, str]:
    """The WAN mode a launcher uses when nothing names one (`bubbletea demo`, bench/atlas.py):
    `kernel` where it can run (root, network namespaces, veth and htb: `check_privileges`), else
    `model`; with a few words saying why, for the launcher's first line of output."""
    try:
        check_privileges()
    except KernelWanError as exc:
        return "model", f"kernel mode cannot run here: {exc.reason}"
    return "kernel", "root, network namespaces available"


# --- sysctls -----------------------------------------------------------------------------------


def _state_file(plan: KernelPlan, key: str) -> Path:
    return STATE_DIR / f"kernel-wan-{plan.tag}.{key}"


def _live_tags() -> set[str]:
    """Tags of the kernel-WAN runs whose namespaces exist now."""
    r = _run_sync(["ip", "netns", "list"])
    tags = set()
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith("bt-") and name.count("-") == 2:
            tags.add(name.split("-")[1])
    return tags


def _others(plan: KernelPlan, key: str) -> list[Path]:
    """State files of other runs that are still up (stale files of dead runs are ignored)."""
    live = _live_tags() - {plan.tag}
    return [p for p in STATE_DIR.glob(f"kernel-wan-*.{key}") if p.name.split(".")[0].split("-")[-1] in live]


def _sysctls_on(plan: KernelPlan) -> None:
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    for key, path, value in plan.sysctls:
        own = _state_file(plan, key)
        others = _others(plan, key)
        if own.exists():  # our crashed predecessor changed it: its saved value is the original
            original = own.read_text().strip()
        elif others:  # another run is up: it saved the original
            original = others[0].read_text().strip()
        else:
            original = Path(path).read_text().strip()
        own.write_text(original + "\n")
        Path(path).write_text(value + "\n")
        log.info("kernel wan sysctl", key=key, value=value, previous=original)


def _sysctls_restore(plan: KernelPlan) -> None:
    for key, path, _ in plan.sysctls:
        own = _state_file(plan, key)
        if not own.exists():
            continue
        original = own.read_text().strip()
        others = _others(plan, key)
        if others:
            log.info("kernel wan sysctl kept", key=key, reason="another kernel-WAN run is up", runs=len(others))
        else:
            Path(path).write_text(original + "\n")
            log.info("kernel wan sysctl restored", key=key, value=original)
        own.unlink(missing_ok=True)


# --- up and down -------------------------------------------------------------------------------


def _firewall(cmds: list[list[str]]) -> list[list[str]]:
    """The plan's FORWARD rules, where there is an iptables to take them (none: no firewall of its
    kind to open either)."""
    return cmds if shutil.which("iptables") else []


def _down_sync(plan: KernelPlan) -> int:
    """Run the plan's down commands, tolerating what is already gone; returns how many removed."""
    for ns in plan.namespaces:
        # A process left inside lives on in a namespace without a name or a link: say so, the
        # launcher should have stopped its workers first.
        pids = _run_sync(["ip", "netns", "pids", ns]).stdout.split()
        if pids:
            log.warning("kernel wan processes left in namespace", namespace=ns, pids=",".join(pids))
    removed = 0
    for cmd in [*_firewall(plan.forward_remove_commands()), *plan.down_commands()]:
        r = _run_sync(cmd)
        if r.returncode == 0:
            removed += 1
        elif not any(m in r.stderr for m in _MISSING):
            log.warning("kernel wan down step failed", cmd=shlex.join(cmd), err=_one_line(r.stderr))
    return removed


def teardown(plan: KernelPlan) -> None:
    """Remove everything of `plan` and restore the sysctls; safe to call twice, or on a plan that
    was never (or half) built. Synchronous, for atexit and signal handlers."""
    t0 = time.monotonic()
    removed = _down_sync(plan)
    try:
        _sysctls_restore(plan)
    except OSError as exc:
        log.warning("kernel wan sysctl restore failed", err=str(exc))
    log.info("kernel wan down", namespaces=len(plan.namespaces), removed=removed, ms=(time.monotonic() - t0) * 1000)


def _check_addresses_free(plan: KernelPlan) -> None:
    """Refuse a base whose subnets another interface already uses (another run, or the site's LAN):
    the routes would clash and traffic would go to the wrong place."""
    r = _run_sync(["ip", "-4", "-o", "addr", "show"])
    nets = [ipaddress.IPv4Network(d.subnet) for d in plan.dcs]
    for line in r.stdout.splitlines():
        parts = line.split()
        if "inet" not in parts:
            continue
        iface = ipaddress.IPv4Interface(parts[parts.index("inet") + 1])
        if any(iface.network.overlaps(n) for n in nets):
            raise KernelWanError(
                f"--wan kernel: addresses {plan.base}.x.x are in use ({iface} on {parts[1]}, another kernel-WAN run?); "
                "give this run another base"
            )


async def _run(cmd: list[str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    return proc.returncode or 0, err.decode(errors="replace")


@asynccontextmanager
async def kernel_wan(plan: KernelPlan) -> AsyncIterator[KernelPlan]:
    """Build `plan` in the kernel for the body of the ``async with``; remove it after.

    A failing step raises `KernelWanError` naming the command and its stderr, after undoing what
    was built. The removal on the way out is synchronous on purpose: it must finish even if the
    task is cancelled again meanwhile (a second Ctrl-C), and it is a few fast `ip` commands."""
    t0 = time.monotonic()
    leftovers = _down_sync(plan)
    if leftovers:
        log.info("kernel wan leftovers removed", run=plan.run, objects=leftovers)
    _check_addresses_free(plan)
    undo = functools.partial(teardown, plan)
    atexit.register(undo)
    try:
        try:
            _sysctls_on(plan)
        except OSError as exc:
            raise KernelWanError(f"--wan kernel: cannot set {IP_FORWARD_PATH}: {exc}; {_ADVICE}") from None
        cmds = [*plan.up_commands(), *_firewall(plan.forward_accept_commands())]
        for cmd in cmds:
            rc, err = await _run(cmd)
            if rc != 0:
                raise KernelWanError(f"--wan kernel: `{shlex.join(cmd)}` failed: {_one_line(err) or f'exit {rc}'}")
        log.info(
            "kernel wan up",
            run=plan.run,
            namespaces=",".join(plan.namespaces),
            links=",".join(f"{s.src}->{s.dst}" for s in plan.links),
            commands=len(cmds),
            ms=(time.monotonic() - t0) * 1000,
        )
        yield plan
    finally:
        with suppress(Exception):
            atexit.unregister(undo)
        teardown(plan)
