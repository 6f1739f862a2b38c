"""What the live page costs the front door: its CPU with 0 pages open, then with 10, under load.

Starts `bubbletea up` as `bench/up_overload.py` does (the default spec, an embedded Redis, the time
scale it measures here), waits until it serves, then sends `--rate` requests/s (open-loop Poisson,
the load generator) for two phases of `--phase` seconds each: no page open, then `--pages` pages
reading `/dashboard/events` (server-sent events, read as a browser does). The front door's CPU is
read from /proc/<pid>/stat (utime + stime) over each phase: seconds of CPU per second. The default
rate, 21/s, is 80% of what the bubbles answered (about 27/s) when `up_overload.py` offered 150/s
(docs/benchmarks.md).

    python bench/dashboard.py --quick       # 20 s phases
    python bench/dashboard.py               # 60 s phases

Prints a summary on stderr, then one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from up_overload import up  # noqa: E402

from loadgen.cli import run_benchmark  # noqa: E402
from loadgen.config import BenchmarkConfig  # noqa: E402

TARGET_CORE_SHARE = 0.02  # the target: the updates cost under 2% of a core


def front_door_pid(out: Path) -> int:
    """The front door `up --out OUT/runs` started (a descendant of that `up`, not another's)."""
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            procs[int(d)] = (cmd, ppid)
    for pid, (cmd, _) in procs.items():
        if "services.prefill_queue" in cmd:
            p = pid
            while p in procs and p > 1:
                if str(out) in procs[p][0]:
                    return pid
                p = procs[p][1]
    raise SystemExit("bench/dashboard: no front door found under this up")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def page(url: str, stop: asyncio.Event, counts: list[int]) -> None:
    """One page: reads the event stream until told to stop, counting its events."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/dashboard/events", timeout=None) as resp:
        resp.raise_for_status()
        i = len(counts)
        counts.append(0)
        while not stop.is_set():
            line = await resp.content.readline()
            if not line:
                return
            if line.startswith(b"event: "):
                counts[i] += 1


async def phase(url: str, pid: int, pages: int, seconds: float, rate: float) -> dict[str, float]:
    stop = asyncio.Event()
    counts: list[int] = []
    readers = [asyncio.create_task(page(url, stop, counts)) for _ in range(pages)]
    await asyncio.sleep(2.0)  # the pages open and take their snapshot before the count starts
    cfg = BenchmarkConfig(
        base_url=url,
        request_rate=rate,
        num_prompts=None,
        duration_s=seconds,
        input_len=96,
        range_ratio=0.5,
        seed=0,
        disable_tqdm=True,
        timeout_s=120.0,
    )
    c0, t0 = cpu_s(pid), time.monotonic()
    result = await run_benchmark(cfg)
    c1, t1 = cpu_s(pid), time.monotonic()
    stop.set()
    for r in readers:
        r.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    answered = result.get("completed")
    return {
        "cpu_s_per_s": round((c1 - c0) / (t1 - t0), 4),
        "seconds": round(t1 - t0, 1),
        "pages": pages,
        "events_per_page": round(sum(counts) / max(1, len(counts)), 1) if counts else 0,
        "answered": answered if isinstance(answered, int) else -1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=21.0, metavar="RPS", help="requests/s; default 21 (80%%)")
    ap.add_argument("--pages", type=int, default=10, help="pages open in the second phase; default 10")
    ap.add_argument("--phase", type=float, default=60.0, metavar="S", help="seconds per phase; default 60")
    ap.add_argument("--quick", action="store_true", help="20 s phases")
    args = ap.parse_args(argv)
    seconds = 20.0 if args.quick else args.phase
    with tempfile.TemporaryDirectory() as tmp, up(Path(tmp)) as (url, k, _worker):
        pid = front_door_pid(Path(tmp))
        print(f"bench/dashboard: up at {url} (front door pid {pid}), k = {k:g}; {args.rate:g}/s", file=sys.stderr)
        none = asyncio.run(phase(url, pid, 0, seconds, args.rate))
        some = asyncio.run(phase(url, pid, args.pages, seconds, args.rate))
    extra = some["cpu_s_per_s"] - none["cpu_s_per_s"]
    out = {
        "bench": "dashboard",
        "time_scale": k,
        "rate": args.rate,
        "no_page": none,
        "pages_open": some,
        "pages_cost_core_share": round(extra, 4),
        "target_core_share": TARGET_CORE_SHARE,
        "met": extra < TARGET_CORE_SHARE,
    }
    print(
        f"bench/dashboard: front door {none['cpu_s_per_s']:.3f} CPU s/s with no page, {some['cpu_s_per_s']:.3f} "
        f"with {args.pages}: the pages cost {extra:.4f} of a core (target < {TARGET_CORE_SHARE})",
        file=sys.stderr,
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
