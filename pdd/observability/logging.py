"""Process logging: one handler on the root logger, text or JSON lines.

    setup_logging(level, json, role="router")      # once at process start (idempotent)

Text:  ``2026-01-02 03:04:05,678 INFO pdd.router.service [chatcmpl-1f..]: message``
JSON:  ``{"ts": "2026-01-02T03:04:05.678Z", "level": "INFO", "logger": "pdd.router.service",
         "msg": "message", "role": "router", "request_id": "chatcmpl-1f.."}`` (one object a line;
       ``request_id`` only when the record was logged inside a bound request, ``worker`` when
       set, ``exc`` with the traceback of ``log.exception``).

The request id comes from ``pdd.observability.context`` (bound per request by the router's
HTTP handler, and on workers from the gRPC ``x-request-id`` metadata). ``level`` and
``json`` default to the environment: ``PDD_LOG_LEVEL`` (INFO) and ``PDD_LOG_JSON=1``.
"""

from __future__ import annotations

import datetime as dt
import json as jsonlib
import logging
import os
import sys
from typing import TextIO

from pdd.observability.context import current_request_id

LEVEL_ENV = "PDD_LOG_LEVEL"
JSON_ENV = "PDD_LOG_JSON"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s"


class _ContextFilter(logging.Filter):
    """Stamps every record with the process labels and the current request id."""

    def __init__(self, role: str, worker: str):
        super().__init__()
        self.role = role
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or current_request_id()
        record.request_id = rid
        record.rid = f" [{rid}]" if rid else ""
        record.role = self.role
        record.worker = self.worker
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (keys: ts, level, logger, msg, role, worker?, request_id?,
    exc?)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC)
        out: dict[str, object] = {
            "ts": ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "role": getattr(record, "role", ""),
        }
        if getattr(record, "worker", ""):
            out["worker"] = record.worker  # type: ignore[attr-defined]
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id  # type: ignore[attr-defined]
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return jsonlib.dumps(out, ensure_ascii=False)


def env_level() -> str:
    return os.environ.get(LEVEL_ENV, "INFO").upper()


def env_json() -> bool:
    return os.environ.get(JSON_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def setup_logging(
    level: str | int | None = None,
    json: bool | None = None,
    *,
    role: str = "",
    worker: str = "",
    stream: TextIO | None = None,
) -> logging.Handler:
    """Install pdd's handler on the root logger (replacing one installed before) and set the
    level. ``None`` takes the level / JSON choice from the environment. Returns the handler.
    Raises ValueError for an unknown level name."""
    level = env_level() if level is None else level
    json = env_json() if json is None else json
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_pdd", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._pdd = True  # type: ignore[attr-defined]
    handler.addFilter(_ContextFilter(role, worker))
    handler.setFormatter(JsonFormatter() if json else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
