"""key=value logging: one line per event, easy to grep and to parse.

Usage::

    log = get_logger(__name__)
    log.info("handled", id=entry_id, kind="ping", attempt=1, ms=0.12)

prints ``ts=2026-11-22T01:02:03.456Z level=info svc=prefill_queue logger=... msg=handled id=...``,
or with ``BUBBLETEA_LOG_FORMAT=json`` the same fields as one JSON object per line
(``{"ts": "...", "level": "info", "svc": "prefill_queue", "logger": "...", "msg": "handled", "id": ...}``)
for log collectors that parse JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_SERVICE = "bubbletea"


def _fmt(value: Any) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if not text or any(c in text for c in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def _ts(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: the same fields as the key=value format, values kept typed."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _ts(record),
            "level": record.levelname.lower(),
            "svc": _SERVICE,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in getattr(record, "fields", {}).items():
            line.setdefault(k, v)  # a field never overwrites the envelope
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = _ts(record)
        parts = [
            f"ts={ts}",
            f"level={record.levelname.lower()}",
            f"svc={_SERVICE}",
            f"logger={record.name}",
            f"msg={_fmt(record.getMessage())}",
        ]
        fields: dict[str, Any] = getattr(record, "fields", {})
        parts.extend(f"{k}={_fmt(v)}" for k, v in fields.items())
        if record.exc_info:
            parts.append(f"exc={_fmt(self.formatException(record.exc_info))}")
        return " ".join(parts)


class KVLogger:
    """A thin wrapper over `logging.Logger` that takes fields as keyword arguments."""

    __slots__ = ("_log",)

    def __init__(self, log: logging.Logger) -> None:
        self._log = log

    def isEnabledFor(self, level: int) -> bool:
        return self._log.isEnabledFor(level)

    def _emit(self, level: int, msg: str, exc: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, msg, exc_info=exc, extra={"fields": fields}, stacklevel=3)

    def debug(self, msg: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, msg, False, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._emit(logging.INFO, msg, False, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._emit(logging.WARNING, msg, False, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, False, fields)

    def exception(self, msg: str, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, True, fields)


def get_logger(name: str) -> KVLogger:
    return KVLogger(logging.getLogger(name))


def setup_logging(service: str, level: str = "INFO", fmt: str = "kv") -> None:
    """Route all logging to stderr as key=value lines (``fmt="kv"``) or JSON lines (``"json"``),
    tagged with the service name. Python warnings (ours or a dependency's) are log records too
    (logger ``py.warnings``, level warning): a line in the process's format, never raw text that
    breaks a JSON log or a command's one-line message."""
    global _SERVICE
    _SERVICE = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.captureWarnings(True)
