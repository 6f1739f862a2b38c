"""What may ride Redis is written down (docs/architecture.md, "What may ride Redis") and pinned here:
every key and stream name `shared/wire/keys.py` builds is classified there as a control stream, a handle
or a small key, and the only tensor-sized exception is the one the page names. The stage worker's
runner, fill executor and reporting reach tensors only through the stage port.

(`tests/e2e/test_redis_contents.py` checks the values themselves on a real run.)
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from shared.wire import keys

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"control", "handle", "small", "exception"}
#: The one tensor-sized value allowed on Redis, opt-in (`prefill.kv_store: redis`), with its reason
#: on the page. Adding one here means writing its reason there too.
EXCEPTIONS = {"kv_cache_key"}


def documented() -> dict[str, str]:
    """name in shared/wire/keys.py -> its kind, from the page's table."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## What may ride Redis\n", 1)[1].split("\n## ", 1)[0]
    found: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`keys."):
            continue
        for name in re.findall(r"`keys\.(\w+)`", cells[0]):
            assert name not in found, f"{name} is classified twice"
            found[name] = cells[1]
    return found


#: keys.py's names that build no key: the prefix, and the hash tags' helpers.
TAG_HELPERS = ("PREFIX", "run_tag", "hash_tag", "dispatch_tag", "under_dispatch_tag")


def key_names() -> set[str]:
    """Every key or stream name (or pattern) shared/wire/keys.py builds: its functions, and its string
    constants under the prefix."""
    names = set()
    for name, value in vars(keys).items():
        if name.startswith("_") or inspect.ismodule(value) or name in TAG_HELPERS:
            continue
        builds = inspect.isfunction(value) and value.__module__ == keys.__name__
        if builds or (isinstance(value, str) and value.startswith(f"{keys.PREFIX}:")):
            names.add(name)
    return names


def test_every_key_and_stream_is_classified_on_the_page() -> None:
    doc = documented()
    missing = key_names() - set(doc)
    assert not missing, f"shared/wire/keys.py builds names docs/architecture.md does not classify: {sorted(missing)}"
    stale = set(doc) - key_names()
    assert not stale, f"docs/architecture.md classifies names shared/wire/keys.py no longer has: {sorted(stale)}"
    assert set(doc.values()) <= KINDS, {n: k for n, k in doc.items() if k not in KINDS}


def test_the_only_tensor_sized_value_is_the_documented_exception() -> None:
    assert {n for n, k in documented().items() if k == "exception"} == EXCEPTIONS
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "**The known exception: `prefill.kv_store: redis`.**" in text  # with its reason


def _imports(path: Path) -> set[str]:
    """Every module and name `path` imports, as "module" and "module.name"."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_runner_the_filler_and_reporting_move_tensors_only_through_the_stage_port() -> None:
    """Every module of the stage worker but the port's own, the transport below it and the worker
    that assembles them (the runner, the fill executor, reporting, and whatever they split into)."""
    below = {
        "shared.dataplane.kvstore",
        "shared.dataplane.DataPlane",
        "shared.dataplane.in_thread",
        "shared.dataplane.plane",
        "shared.dataplane.kv",
        "shared.dataplane.kv_client",
        "services.stage_worker.port.transport.Transport",
        "services.stage_worker.port.state",
        "services.stage_worker.port.prefill.PrefillPort",
        "services.stage_worker.membership.generations.CheckpointStore",
    }
    assembly = {"port/stage_port.py", "port/state.py", "port/prefill.py", "port/transport.py", "worker.py"}
    movers = ("train/runner.py", "fill/executor.py", "fill/reporting.py")
    checked = []
    home = ROOT / "services" / "stage_worker"
    for path in sorted(home.rglob("*.py")):
        name = path.relative_to(home).as_posix()
        if name in assembly:
            continue
        checked.append(name)
        reached = sorted(_imports(path) & below)
        assert not reached, f"{name} reaches past the stage port: {reached}"
        source = path.read_text(encoding="utf-8")
        assert ".plane." not in source, f"{name} reaches into the data plane past the port"
        if name in movers:  # (leases and generations write small keys)
            for call in ("redis.set(", "redis.hset(", "pipe.set(", "pipe.hset("):
                assert call not in source, f"{name} writes to Redis what the port should: {call!r}"
    assert set(movers) <= set(checked)
