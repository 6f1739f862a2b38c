"""Soak: does memory stay bounded under a steady load? (issue 14, item 6)

Starts a private redis-server (with the embedded server's maxmemory and noeviction), runs
`bubbletea up` on it (every service, training until stopped), drives a steady load with the load
generator, and samples every process's RSS (/proc/<pid>/status VmRSS) and Redis's used_memory every
few seconds. Prints progress, then one JSON line last: the growth after warm-up (the first sample
after it against the last), per process and for Redis.

    python bench/soak.py --minutes 2 [--rate 20] [--input-len 256] [--every 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from redis import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.procfs import command_words  # noqa: E402
from shared.bus.connection import sync_client_for  # noqa: E402
from shared.runtime.redis_server import EmbeddedRedis, free_port  # noqa: E402


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def name_of(pid: int) -> str:
    words = command_words(pid)
    if words is None:
        return str(pid)
    for part in words:
        if part.startswith("services."):
            return part.removeprefix("services.")
    text = " ".join(words)
    return "up" if "bubbletea" in text else text[:40]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def wait_ready(url: str, up: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"bubbletea up exited with {up.returncode} before serving was ready")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)  # a poll: /ready is the only signal there is
    raise SystemExit(f"serving not ready within {timeout:.0f}s")


def family(key: str) -> str:
    """A key's family: its name with ids and numbers left out (bt:{<run>}:prefill:snap:<id>:<layer>
    -> bt:*:prefill:snap), so the memory of each kind of record can be added up."""
    parts = key.split(":")
    if len(parts) > 2 and parts[1] not in ("prefill", "decode", "serving", "health", "dead", "ping", "pong"):
        parts[1] = "*"  # the run id
    kept = [p for p in parts[:4] if not any(c.isdigit() for c in p) or p.startswith("bt")]
    return ":".join(kept)


def memory_by_family(r: Redis) -> dict[str, float]:
    """MB of Redis memory per key family (MEMORY USAGE of every key), largest first."""
    sizes: dict[str, int] = {}
    for raw in r.scan_iter(count=1000):
        key = raw.decode()
        used: Any = r.memory_usage(key, samples=0) or 0  # 0: every element, not a sample
        sizes[family(key)] = sizes.get(family(key), 0) + int(used)
    return {k: round(v / 2**20, 1) for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:8]}


def growth(first: float, last: float) -> float:
    return round((last - first) / first * 100, 2) if first else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0, help="how long the load runs (default 5)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the run that is warm-up (default 0.25)")
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    args = p.parse_args(argv)
    duration = args.minutes * 60
    out = Path(tempfile.mkdtemp(prefix="bubbletea-soak-"))
    redis_srv = EmbeddedRedis().start()
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_srv.url, "BUBBLETEA_HTTP_PORT": str(port), "BUBBLETEA_CONFIG": args.config}
    env.pop("BUBBLETEA_API_KEY", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "bubbletea.cli", "up", "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    r = sync_client_for(redis_srv.url, protocol=None)
    samples: list[dict[str, Any]] = []
    families: dict[str, float] = {}
    load: subprocess.Popen[bytes] | None = None
    try:
        api = f"http://127.0.0.1:{port}"
        wait_ready(api, up, 180)
        load_cmd = [sys.executable, "-m", "loadgen", "--base-url", api, "--request-rate", str(args.rate)]
        load_cmd += ["--duration", str(duration), "--random-input-len", str(args.input_len)]
        load_cmd += ["--random-range-ratio", "0"]
        load_cmd += ["--disable-tqdm", "--json-out", str(out / "load.json")]
        load = subprocess.Popen(load_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        t0 = time.monotonic()
        while load.poll() is None:
            pids = [up.pid, *descendants(up.pid)]
            assert redis_srv.proc is not None
            rss = {f"{name_of(pid)}-{pid}": rss_kb(pid) for pid in pids}
            rss[f"redis-{redis_srv.proc.pid}"] = rss_kb(redis_srv.proc.pid)
            info: Any = r.info("memory")
            sample = {
                "t": round(time.monotonic() - t0, 1),
                "redis_used_memory": int(info["used_memory"]),
                "rss_kb": {k: v for k, v in rss.items() if v is not None},
            }
            samples.append(sample)
            if not families and time.monotonic() - t0 > duration - 2 * args.every:
                families = memory_by_family(r)  # near the end, still under load: what holds the memory
                mem: Any = r.info("memory")
                families["(dataset, all keys)"] = round(int(mem["used_memory_dataset"]) / 2**20, 1)
                families["(used_memory)"] = round(int(mem["used_memory"]) / 2**20, 1)
            print(json.dumps({"t": sample["t"], "redis_used_mb": round(sample["redis_used_memory"] / 2**20, 1)}))
            time.sleep(args.every)  # a sampling period
        loadgen = json.loads((out / "load.json").read_text()) if (out / "load.json").exists() else {}
    finally:
        if load is not None and load.poll() is None:
            load.terminate()
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        r.close()
        redis_srv.stop()
    after = [s for s in samples if s["t"] >= duration * args.warmup]
    first, last = after[0], after[-1]
    per_proc = {k: growth(first["rss_kb"][k], last["rss_kb"][k]) for k in first["rss_kb"] if k in last["rss_kb"]}
    summaries = list(out.glob("*/summary.json"))  # `up`'s run folder: the time scale it ran at
    scale = json.loads(summaries[0].read_text()).get("device_time_scale") if summaries else None
    result = {
        "time_scale_k": scale,
        "minutes": args.minutes,
        "rate": args.rate,
        "input_len": args.input_len,
        "samples": len(samples),
        "warmup_s": duration * args.warmup,
        "redis_used_memory_start_mb": round(samples[0]["redis_used_memory"] / 2**20, 1),
        "redis_used_memory_after_warmup_mb": round(first["redis_used_memory"] / 2**20, 1),
        "redis_used_memory_end_mb": round(last["redis_used_memory"] / 2**20, 1),
        "redis_used_memory_max_mb": round(max(s["redis_used_memory"] for s in samples) / 2**20, 1),
        "redis_used_memory_growth_pct": growth(first["redis_used_memory"], last["redis_used_memory"]),
        "rss_growth_pct": per_proc,
        "rss_growth_pct_max": max(per_proc.values(), default=0.0),
        "rss_end_mb_total": round(sum(last["rss_kb"].values()) / 1024, 1),
        "redis_mb_by_family_under_load": families,
        "completed": loadgen.get("completed"),
        "failed": loadgen.get("failed"),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
