"""Spec fields still accepted but no longer used: which they are, the warning a spec naming one
gets (`deprecated_fields`), and a spec written out without them (`spec_builtins`)."""

from __future__ import annotations

from typing import Any

import msgspec

#: Spec fields still accepted but no longer used, and what replaced each.
DEPRECATED = {
    "bubbletea.guard_ms": "a worker fills a bubble until its training input arrives; no margin is kept",
    "bubbletea.dispatch_overhead_ms": "work is queued on the worker before its bubble opens",
    "bubbletea.keep_ahead_ms": "see bubbletea.credit_bubbles",
    "bubbletea.stage_ms": "see bubbletea.credit_bubbles and bubbletea.max_credit_ms",
}


def deprecated_fields(data: object) -> list[str]:
    """One line per field of the raw spec `data` that is accepted but no longer used."""
    section = data.get("bubbletea") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        return []
    return [f"{path}: no longer used ({why})" for path, why in DEPRECATED.items() if path.split(".", 1)[1] in section]


def spec_builtins(spec: msgspec.Struct) -> dict[str, Any]:
    """A spec as plain values to write out (a launcher's run folder), without the fields that are
    accepted but no longer used: a spec written here loads again with no deprecation warning."""
    raw: dict[str, Any] = msgspec.to_builtins(spec)
    for path in DEPRECATED:
        section, name = path.split(".", 1)
        raw.get(section, {}).pop(name, None)
    return raw
