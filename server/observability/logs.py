"""The log format of every process the server starts (the server, the engine and front-end
processes of ``--frontend-workers``, the dataset jobs): text, or with ``--log-format json`` one JSON
object a line.

A JSON line has ``timestamp`` (RFC 3339, UTC, milliseconds), ``level``, ``logger`` and ``message``;
``request_id`` when the line was written inside a request (server.context), ``exception`` with the
traceback when there is one, and the fields a request's own line carries (``REQUEST_FIELDS``),
given through ``extra=``. uvicorn's loggers are routed to the same handler, so its lines are JSON
too.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from server import context

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a request's line carries (``log.info(..., extra={...})``), in this order.
REQUEST_FIELDS = ("method", "path", "rpc", "status", "duration_ms", "request_id", "model", "trace_id")
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object a line; never raises on a value json cannot encode (it becomes its str)."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        out = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
               + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key in REQUEST_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = value
        if "request_id" not in out:
            rid = context.request_id.get()
            if rid != "-":
                out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exception"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: int | str, fmt: str = "text") -> None:
    """Set the process's logging: the root logger writes to stdout in ``fmt`` at ``level``, and
    uvicorn's loggers (which ``uvicorn.Config`` gives handlers of their own, on stderr, unless told
    ``log_config=None``: see ``uvicorn_log_config``) write through it."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt == "text":  # as before: a no-op where the root logger has handlers already
        logging.basicConfig(level=level, stream=sys.stdout, format=TEXT_FORMAT)
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True


def uvicorn_log_config(fmt: str) -> dict:
    """``uvicorn.Config``'s logging options: its own stderr handlers in text (as before), none in
    json, where its loggers propagate to the root's JSON handler."""
    return {"log_config": None} if fmt == "json" else {}
