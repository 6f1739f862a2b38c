"""A spec's validation errors as a person reads them: the field first, then what it allows, or,
for an unknown key, the one meant (`validation_message`, used by `shared.config.spec.parse_spec`)."""

from __future__ import annotations

import re

import msgspec.inspect as mi


def validation_message(root: type, text: str) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.datacenters[0].gpus`" for a spec of type `root`, as
    "datacenters[0].gpus: Expected `int` >= 1 (allowed: >= 1 and <= 1000000)"."""
    m = _PATH.search(text)
    field = m.group(1) if m and m.group(1) else "(top level)"
    hint = _allowed(root, field) if m else ""
    if _UNKNOWN.search(text):
        hint = _nearest(root, m.group(1) if m else "", text)
    return f"{field}: {_PATH.sub('', text)}" + (f" ({hint})" if hint else "")


_PATH = re.compile(r" - at `\$\.?(.*)`$")


def _type_at(root: type, path: str) -> mi.Type | None:
    """The type of the field at `path` (e.g. ``datacenters[0].gpus``; "" is the spec), past any
    `X | None` and list; None when the path names no field."""
    t: mi.Type = mi.type_info(root)
    parts = [p for p in re.sub(r"\[\d+\]", "", path).split(".") if p]
    for part in [None, *parts]:
        if part is not None:
            fields = {f.name: f.type for f in t.fields} if isinstance(t, mi.StructType) else {}
            if part not in fields:
                return None
            t = fields[part]
        while isinstance(t, mi.UnionType):  # `X | None`: describe X
            t = next(a for a in t.types if not isinstance(a, mi.NoneType))
        while isinstance(t, (mi.VarTupleType, mi.ListType)):
            t = t.item_type
    return t


def _allowed(root: type, path: str) -> str:
    """Describe what the field at `path` (e.g. ``datacenters[0].gpus``) accepts, from its type."""
    t = _type_at(root, path)
    if isinstance(t, mi.LiteralType):
        return "allowed: " + ", ".join(map(str, t.values))
    if isinstance(t, (mi.IntType, mi.FloatType)):
        lo = f">= {t.ge}" if t.ge is not None else f"> {t.gt}" if t.gt is not None else ""
        hi = f"<= {t.le}" if t.le is not None else f"< {t.lt}" if t.lt is not None else ""
        return "allowed: " + " and ".join(x for x in (lo, hi) if x) if lo or hi else ""
    return ""


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def _nearest(root: type, section: str, text: str) -> str:
    """For msgspec's "unknown field `x`" in `section`: the field meant, or the fields there are."""
    import difflib

    m = _UNKNOWN.search(text)
    t = _type_at(root, section)
    if m is None or not isinstance(t, mi.StructType):
        return ""
    names = [f.name for f in t.fields]
    near = difflib.get_close_matches(m.group(1), names, n=1)
    return f"did you mean `{near[0]}`?" if near else "the fields there: " + ", ".join(names)
