"""What a bench prints: progress on stderr, and its verdict in its one JSON line, last on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any


def verdict(problems: list[str], ok: str) -> dict[str, Any]:
    """``valid`` and ``why``: `ok` when nothing went wrong, else the problems (the first three)."""
    if not problems:
        return {"valid": True, "why": ok}
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return {"valid": False, "why": "; ".join(problems[:3]) + more}


def emit(result: dict[str, Any]) -> None:
    """The bench's one JSON line, last on stdout."""
    print(json.dumps(result), flush=True)


def stderr(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)
