"""`--wan kernel` on this machine's kernel: real namespaces, real veths, real htb, real TCP.

A 2-DC spec (PP=2, DP=1) with an 80 Mbit/s link and a per-connection cap of about a quarter of it
(window 0.025 MiB over a 10 ms RTT: 20.97 Mbit/s). A receiver runs in dc-b's namespace on a dc-b
worker address, a sender in dc-a's bound to dc-a worker addresses; the receiver counts what each
connection delivers over one second after a short warm-up; the demo's own tiny rates (3.28 Mbit/s,
a quarter of it per connection) are checked the same way. Then: everything of a plan is gone
after the context (however it ends), ip_forward is back, and an unprivileged user gets one line.

Needs root and a kernel with namespaces, veth, htb and u32: skipped otherwise, with the reason
`check_privileges` gives (the refusal test runs either way).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bubbletea.launcher.kernel_wan import KernelWanError, check_privileges, default_wan_mode, kernel_wan, teardown
from shared.config.spec import ClusterSpec, load_spec, parse_spec
from shared.dataplane.kernel_net import KernelPlan, link_rates, plan_kernel_net

# Kernel WANs share the host (namespaces, addresses, ip_forward): one such test at a time (conftest).
pytestmark = [pytest.mark.kernel_wan]

SCRIPT = str(Path(__file__).with_name("kernel_wan_traffic.py"))
SPEC: ClusterSpec = parse_spec(
    {
        "name": "kwan",
        "datacenters": [{"name": "dc-a", "gpus": 1}, {"name": "dc-b", "gpus": 1}],
        "wan": {"default": {"latency_ms": 5.0, "bandwidth_gbps": 0.08, "tcp_window_mib": 0.025, "connections": 8}},
        "parallelism": {"pp": 2, "dp": 1},
    }
)
LINK_BPS, CAP_BPS = link_rates(SPEC.link("dc-a", "dc-b"))  # bytes/s: 10 MB/s and 2.62 MB/s
TOLERANCE = 0.15
#: A window-bound rate's lower bound under the suite's load (its RTT grows with the host's).
WINDOW_LOW = 0.7
WARMUP_S, WINDOW_S = 0.3, 1.0


def _why_not() -> str | None:
    try:
        check_privileges()
    except KernelWanError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def privileged() -> None:
    if (why := _why_not()) is not None:
        pytest.skip(f"needs root and network namespaces: {why}")


def ip_forward() -> str:
    return Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()


def forward_rules(plan: KernelPlan) -> list[str]:
    """The FORWARD rules naming one of `plan`'s interfaces (none where there is no iptables)."""
    if shutil.which("iptables") is None:
        return []
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, check=True).stdout
    return [r for r in rules.splitlines() if any(f" {d.host_if} " in f"{r} " for d in plan.dcs)]


def remains(plan: KernelPlan) -> list[str]:
    """Names of `plan`'s namespaces and root-side interfaces that exist now."""
    nss = {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                      check=True).stdout.splitlines() if line.strip()}  # fmt: skip
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return sorted((set(plan.namespaces) & nss) | (set(plan.interfaces) & names))


@pytest.fixture
async def wan(privileged: None) -> AsyncIterator[KernelPlan]:
    plan = plan_kernel_net(SPEC, "kwan-test-shaping")
    async with kernel_wan(plan):
        yield plan


@dataclasses.dataclass(frozen=True)
class Measured:
    rates: list[float]  # bytes/s of each connection
    total: float


async def measure(plan: KernelPlan, sources: list[str], *, from_root: bool = False) -> Measured:
    """Bytes/s delivered to a dc-b worker address by one connection per source address (sent from
    dc-a's namespace, or from the root namespace)."""
    dst = plan.worker_addresses("dc-b", 0)[0]
    recv = await asyncio.create_subprocess_exec(
        *plan.netns_prefix("dc-b"), sys.executable, SCRIPT, "recv", dst, str(len(sources)), str(WARMUP_S),
        str(WINDOW_S), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    send: asyncio.subprocess.Process | None = None
    try:
        assert recv.stdout is not None
        port = (await asyncio.wait_for(recv.stdout.readline(), 20)).decode().split()[1]
        prefix = [] if from_root else plan.netns_prefix("dc-a")
        send = await asyncio.create_subprocess_exec(*prefix, sys.executable, SCRIPT, "send", dst, port, *sources)
        raw = json.loads(await asyncio.wait_for(recv.stdout.readline(), 20))
        result = Measured(rates=[float(r) for r in raw["rates"]], total=float(raw["total"]))
    finally:
        for proc in (send, recv):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
    print(f"sources={len(sources)} from_root={from_root} result={result}")
    return result


def near(measured: float, expected: float) -> bool:
    return abs(measured - expected) <= TOLERANCE * expected


async def measure_shaped(plan: KernelPlan, sources: list[str], expected: float) -> Measured:
    """`measure`, once more if the first came in short of the shaped rate: the senders are Python
    processes, and with the suite's other worker busy on a 2-core machine they were seen starved to
    0.78-0.79 of it (a fresh-clone `make test`, 2026-12-06; alone the same tests pass). A rate above
    the shaping is never measured again: that would be the shaping failing."""
    got = await measure(plan, sources)
    if got.total < (1 - TOLERANCE) * expected:
        got = await measure(plan, sources)
    return got


async def test_one_connection_gets_the_per_connection_cap(wan: KernelPlan) -> None:
    got = await measure_shaped(wan, wan.worker_addresses("dc-a", 0)[:1], CAP_BPS)
    assert near(got.total, CAP_BPS), (got, CAP_BPS)


@pytest.mark.parametrize("n", [2, 8])
async def test_connections_together_get_the_link_or_their_caps(wan: KernelPlan, n: int) -> None:
    # 2 connections: window-bound (2 x 2.62 MB/s); 8: link-bound (10 MB/s, shared equally)
    expected = min(LINK_BPS, n * CAP_BPS)
    got = await measure_shaped(wan, wan.worker_addresses("dc-a", 0)[:n], expected)
    if n * CAP_BPS < LINK_BPS:  # window-bound: window / RTT, and a loaded 2-core host adds to the RTT
        # (0.78-0.80 of it twice running in a full make test, 2026-12-06; alone within 15%)
        assert WINDOW_LOW * expected <= got.total <= (1 + TOLERANCE) * expected, (got, expected)
    else:
        assert near(got.total, expected), (got, expected)
    assert len(got.rates) == n
    assert all(r <= CAP_BPS * (1 + TOLERANCE) for r in got.rates), got


@pytest.mark.parametrize("n", [1, 8])
async def test_the_demos_tiny_rates_are_shaped_too(privileged: None, n: int) -> None:
    # configs/demo.yaml: a 3.28 Mbit/s link, a quarter of it per connection (1 KiB window, 10 ms RTT)
    spec = load_spec(Path(__file__).parents[2] / "configs" / "demo.yaml")
    plan = plan_kernel_net(spec, "kwan-test-demo")
    link, cap = link_rates(spec.link("dc-a", "dc-b"))
    async with kernel_wan(plan):
        got = await measure(plan, plan.worker_addresses("dc-a", 0)[:n])
    assert near(got.total, min(link, n * cap)), (got, link, cap)


async def test_traffic_from_the_root_namespace_is_not_shaped(wan: KernelPlan) -> None:
    got = await measure(wan, ["-"], from_root=True)
    assert got.total > 5 * LINK_BPS, got


async def test_everything_is_removed_and_ip_forward_restored(privileged: None) -> None:
    plan = plan_kernel_net(SPEC, "kwan-test-down")
    before = ip_forward()
    async with kernel_wan(plan):
        assert remains(plan) == sorted([*plan.namespaces, *(d.host_if for d in plan.dcs)])
        assert ip_forward() == "1"
        if shutil.which("iptables"):  # forwarding accepted even where the policy drops (a Docker engine's)
            assert sorted(forward_rules(plan)) == sorted(f"-A FORWARD -i {d.host_if} -j ACCEPT" for d in plan.dcs)
    assert remains(plan) == []
    assert forward_rules(plan) == []
    assert ip_forward() == before


async def test_teardown_when_the_body_raises(privileged: None) -> None:
    plan = plan_kernel_net(SPEC, "kwan-test-raise")
    before = ip_forward()
    with pytest.raises(RuntimeError, match="boom"):
        async with kernel_wan(plan):
            raise RuntimeError("boom")
    assert remains(plan) == []
    assert ip_forward() == before


async def test_teardown_when_cancelled(privileged: None) -> None:
    plan = plan_kernel_net(SPEC, "kwan-test-cancel")
    before = ip_forward()
    up = asyncio.Event()

    async def body() -> None:
        async with kernel_wan(plan):
            up.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(body())
    await asyncio.wait_for(up.wait(), 20)
    task.cancel()  # what Ctrl-C does to the launcher's main task
    with pytest.raises(asyncio.CancelledError):
        await task
    assert remains(plan) == []
    assert ip_forward() == before


async def test_leftovers_of_a_crashed_run_are_removed_first(privileged: None) -> None:
    plan = plan_kernel_net(SPEC, "kwan-test-crash")
    before = ip_forward()
    for cmd in plan.up_commands()[:4]:  # half a plan, as a killed run leaves it
        proc = await asyncio.create_subprocess_exec(*cmd)
        assert await proc.wait() == 0, cmd
    try:
        async with kernel_wan(plan):
            assert ip_forward() == "1"
        assert remains(plan) == []
        assert ip_forward() == before
    finally:
        teardown(plan)


async def test_a_failing_step_names_the_command_and_undoes_the_rest(privileged: None) -> None:
    plan = plan_kernel_net(SPEC, "kwan-test-fail")
    bad = dataclasses.replace(plan.dcs[1], control_address="10.77.2.300")
    plan = dataclasses.replace(plan, dcs=(plan.dcs[0], bad))
    before = ip_forward()
    with pytest.raises(KernelWanError) as err:
        async with kernel_wan(plan):
            pytest.fail("the body must not run")
    assert "`ip addr add 10.77.2.300/24 dev" in str(err.value) and "\n" not in str(err.value)
    assert remains(plan) == []
    assert ip_forward() == before


async def test_two_runs_at_once_need_two_bases(privileged: None) -> None:
    first, clash = plan_kernel_net(SPEC, "kwan-test-one"), plan_kernel_net(SPEC, "kwan-test-two")
    second = plan_kernel_net(SPEC, "kwan-test-two", base="10.78")
    before = ip_forward()
    async with kernel_wan(first):
        with pytest.raises(KernelWanError, match="in use"):
            async with kernel_wan(clash):
                pytest.fail("the body must not run")
        async with kernel_wan(second):
            assert len(remains(first)) == len(remains(second)) == 4
        assert ip_forward() == "1", "the first run is still up: forwarding stays on"
        assert remains(second) == []
    assert ip_forward() == before


#: Prepended to the code `as_nobody` runs, after its imports: from here on the interpreter is user
#: nobody (uid and gid 65534, no supplementary groups; leaving uid 0 drops every capability).
DROP_TO_NOBODY = "import os\nos.setgroups([])\nos.setgid(65534)\nos.setuid(65534)\n"


def as_nobody(imports: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` as user nobody in a new interpreter, after `imports` ran as root. Not `setpriv`
    before the interpreter starts: the checkout and its environment may live where nobody can read
    them (a clone in a 0700 home directory), and then nobody could not import bubbletea at all."""
    return subprocess.run(
        [sys.executable, "-c", imports + DROP_TO_NOBODY + code],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
    )  # fmt: skip


def test_an_unprivileged_user_is_refused_in_one_line() -> None:
    if os.geteuid() != 0:  # we are the unprivileged user
        with pytest.raises(KernelWanError) as err:
            check_privileges()
        lines = [str(err.value)]
    else:
        r = as_nobody(
            "from bubbletea.launcher.kernel_wan import KernelWanError, check_privileges\n",
            "try:\n    check_privileges()\nexcept KernelWanError as exc:\n    print(exc)\n    raise SystemExit(3)\n",
        )
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert "(running as uid 65534)" in r.stdout, r.stdout  # the check ran as nobody
        lines = r.stdout.splitlines()
    assert len(lines) == 1, lines
    assert "--wan kernel needs root" in lines[0] and "--wan model" in lines[0], lines[0]


def test_the_default_wan_mode_is_kernel_where_it_can_run_and_model_elsewhere_saying_why() -> None:
    """`bubbletea demo` and bench/atlas.py default to kernel mode only where it can be built."""
    mode, why = default_wan_mode()
    if _why_not() is None:
        assert (mode, why) == ("kernel", "root, network namespaces available")
    else:
        assert mode == "model" and why.startswith("kernel mode cannot run here: "), why
    if os.geteuid() != 0:
        return
    r = as_nobody(
        "from bubbletea.launcher.kernel_wan import default_wan_mode\n", "print(*default_wan_mode(), sep='|')\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "model|kernel mode cannot run here: not root (uid 65534)"
