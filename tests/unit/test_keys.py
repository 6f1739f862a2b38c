"""Every key of a run carries the run's hash tag, and every script and MULTI is given keys of one tag:
one slot of a Redis Cluster (docs/architecture.md, "Keys by hash tag")."""

from __future__ import annotations

import ast
import inspect
import time
from pathlib import Path
from typing import Any

import pytest

from bubbletea.cli_common import run_id_argument
from services.dispatcher.writes import _fenced
from shared.config import env_values
from shared.config.spec import ConfigError
from shared.control import serving
from shared.dataplane import kvstore
from shared.wire import PrefillRequest, PrefillResult, keys
from shared.wire.status import RequestStatus

ROOT = Path(__file__).resolve().parents[2]
RUN = "run-7.a_b"
#: keys.py's functions that build no key of a run, or one in another key's slot (its tag)
HELPERS = {
    "run_tag",
    "hash_tag",
    "dead_letter_stream",
    "health_key",
    "replication_fence_key",
    "dispatch_tag",
    "under_dispatch_tag",
    "run_pattern",
}


def run_key_builders() -> dict[str, Any]:
    """Every public function of keys.py whose first parameter is the run."""
    out = {}
    for name, fn in vars(keys).items():
        if name.startswith("_") or name in HELPERS or not inspect.isfunction(fn) or fn.__module__ != keys.__name__:
            continue
        params = list(inspect.signature(fn).parameters)
        assert params and params[0] == "run", f"keys.{name} builds a key without naming its run first"
        out[name] = fn
    return out


def built(fn: Any, run: str) -> list[str]:
    """What `fn` builds for `run`, the other parameters filled in (ints 3, strings "x"; a datacenter
    left at its default, None: a dispatcher per datacenter's keys are tests/unit/test_dispatch_per_dc.py's)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    args = [run] + [3 if p.annotation in (int, "int") else "x" for p in params if p.default is inspect.Parameter.empty]
    got = fn(*args)
    return list(got) if isinstance(got, tuple) else [got]


def test_hash_tag_reads_keys_as_redis_cluster_does() -> None:
    assert keys.hash_tag("bt:{r1}:gen") == "r1"
    assert keys.hash_tag("{a}{b}") == "a"  # the first
    assert keys.hash_tag("a{b{c}d}") == "b{c"  # to the first "}" after the first "{"
    assert keys.hash_tag("bt:{}:x{y}") is None  # empty: the whole key is hashed
    assert keys.hash_tag("bt:dead") is None and keys.hash_tag("bt:{open") is None


def test_every_key_of_a_run_carries_the_run_as_its_hash_tag() -> None:
    builders = run_key_builders()
    assert {"prefill_request_key", "prefill_results_stream", "kv_cache_key", "kv_budget_bucket_key"} <= set(builders)
    assert {"generation_key", "lease_key", "checkpoint_key", "plane_prefix", "idempotency_key"} <= set(builders)
    for name, fn in builders.items():
        # one that must name a datacenter ("x") is that datacenter's, under its tag (keys.dispatch_tag)
        dc = inspect.signature(fn).parameters.get("dc")
        tag = f"{RUN}:x" if dc is not None and dc.default is inspect.Parameter.empty else RUN
        for key in built(fn, RUN):
            assert key.startswith(f"bt:{{{tag}}}:"), (name, key)
            assert keys.hash_tag(key) == tag, (name, key)
    assert keys.run_tag(RUN) == "{run-7.a_b}"


def test_a_run_id_with_a_brace_is_refused_saying_why() -> None:
    for bad in ("a{b", "a}b", "{a}", ""):
        with pytest.raises(ValueError, match="hash tag"):
            keys.run_tag(bad)
        with pytest.raises(ConfigError, match="BUBBLETEA_RUN"):
            env_values.run_id(bad)
        with pytest.raises(Exception, match="letters, digits"):
            run_id_argument(bad)
    assert run_id_argument(RUN) == RUN


def test_dead_letters_go_to_the_dead_letter_stream_of_their_stream_s_tag() -> None:
    for stream in (keys.prefill_requests_stream(RUN), keys.inbox(RUN, 1, 2), keys.wan_stream(RUN)):
        dead = keys.dead_letter_stream(stream)
        assert dead == keys.run_dead_letter_stream(RUN) == f"bt:{{{RUN}}}:dead"
        assert keys.hash_tag(dead) == keys.hash_tag(stream)  # the XADD and the XACK: one slot
    # an untagged stream's dead letters: its whole name as their tag, the slot Redis Cluster gives it
    assert keys.dead_letter_stream(keys.PING_STREAM) == "bt:{bt:ping}:dead"
    assert keys.hash_tag(keys.dead_letter_stream("s")) == "s"
    with pytest.raises(ValueError, match="no hash tag"):
        keys.dead_letter_stream("a{}b")
    assert keys.dead_letter_stream("bt:{other}:x") == "bt:{other}:dead"
    import fnmatch  # Redis's MATCH: "*" any run (braces are not special)

    assert fnmatch.fnmatchcase(keys.run_dead_letter_stream(RUN), keys.DEAD_LETTER_PATTERN)
    assert fnmatch.fnmatchcase(keys.dead_letter_stream(keys.PING_STREAM), keys.DEAD_LETTER_PATTERN)
    assert fnmatch.fnmatchcase(keys.lease_key(RUN, 0, 1), keys.run_pattern(RUN))
    assert not fnmatch.fnmatchcase(keys.lease_key(RUN + "x", 0, 1), keys.run_pattern(RUN))


def script_keys(args: tuple[Any, ...]) -> list[str]:
    """The KEYS of an EVAL's arguments (script, numkeys, keys..., argv...)."""
    return [str(k) for k in args[2 : 2 + int(args[1])]]


def one_tag(keys_given: list[str]) -> str | None:
    tags = {keys.hash_tag(k) for k in keys_given}
    assert len(tags) == 1, f"keys of several slots in one script: {keys_given}"
    return tags.pop()


def test_the_serving_scripts_touch_the_run_s_keys_alone() -> None:
    results = keys.prefill_results_stream(RUN, "prefill_queue-1")
    req = PrefillRequest(id="pf-1", model="m", tokens=(1, 2), submitted=time.time(), reply_to=results)
    assert one_tag(script_keys(serving.accept_args(RUN, req, 10))) == RUN
    assert one_tag(script_keys(serving.accept_args(RUN, req, 10, idempotency_key="k"))) == RUN
    answer = PrefillResult(id="pf-1", status=RequestStatus.DONE)
    assert one_tag(script_keys(serving._answer_args(RUN, answer, results))) == RUN
    fence = (keys.dispatcher_lease_key(RUN), "dispatcher-1")
    assert one_tag(script_keys(serving._answer_args(RUN, answer, results, fence))) == RUN


def test_the_dispatcher_s_fenced_writes_touch_the_run_s_keys_alone() -> None:
    fence = (keys.dispatcher_lease_key(RUN), "dispatcher-1")
    batches = [(keys.fill_stream(RUN, 0, 1), b"b"), (keys.fill_stream(RUN, 1, 0), b"c")]
    gone = [keys.prefill_snapshot_key(RUN, "pf-1", 2)]
    acks = [
        (keys.prefill_requests_stream(RUN), "dispatcher", ["1-0"]),
        (keys.prefill_reports_stream(RUN), "d", ["2-0"]),
    ]
    assert one_tag(script_keys(_fenced(fence, batches, gone, acks))) == RUN


def test_the_kv_budget_script_touches_the_run_s_keys_alone() -> None:
    got = kvstore.budget_keys(RUN, "pf-1", 600, 1_700_000_000.0)
    assert got[0] == keys.kv_cache_key(RUN, "pf-1") and len(got) > 2
    assert one_tag(got) == RUN


def test_no_source_module_builds_a_key_by_hand() -> None:
    """Keys are built by shared/wire/keys.py alone (so that each carries its tag): no "bt:..." string
    literal elsewhere in the services, the shared code, the launcher or the benchmarks."""
    found = []
    for top in ("shared", "services", "bubbletea", "bench", "loadgen", "sim"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "shared" / "wire" / "keys.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("bt:"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:40]!r}")
    assert not found, found
