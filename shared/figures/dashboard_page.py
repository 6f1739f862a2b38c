"""The run page's HTML, one file with its CSS and script inline (no external URL): the front door
serves it live (`/dashboard`, its data from `/dashboard/events`), the report writes it with a
finished run's view inlined (dashboard.html). The drawing is shared/figures/dashboard_assets/page.js.

Tested by: tests/unit/test_dashboard_view.py, tests/integration/test_dashboard.py.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def _asset(name: str) -> str:
    return (resources.files("shared.figures") / "dashboard_assets" / name).read_text(encoding="utf-8")


def _inline_json(value: Any) -> str:
    """JSON that is safe inside a <script> element ("</" cannot close it)."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def render(*, title: str, view: dict[str, Any] | None = None, events: str = "/dashboard/events") -> str:
    """The page: with `view`, a finished run's (drawn from it, no server needed); without, the live
    page, which reads its views from the server-sent events at `events`."""
    boot = {"view": view} if view is not None else {"events": events}
    page = _asset("page.html").replace("__CSS__", _asset("page.css")).replace("__JS__", _asset("page.js"))
    return page.replace("__TITLE__", title.replace("<", "&lt;")).replace("__DATA__", _inline_json(boot))
