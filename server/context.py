"""Per-request context carried across the event loop, the decode pool and the batcher.

The observe middleware sets them at the door; everything below reads them, so the request id
reaches every log line of the request (the batcher's too) and one deadline bounds the whole
request: parsing, decoding and the queue.
"""

from __future__ import annotations

import contextvars
import time

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("softmoe_request_id", default="-")
deadline: contextvars.ContextVar[float] = contextvars.ContextVar("softmoe_deadline", default=float("inf"))
# A traced request's stage records, ``(stage, model, start, end, batch)`` with perf_counter seconds
# and ``batch`` None or ``(batch id, batch size)``; None (the default) when the request is not
# traced, and then nothing is recorded (server.observability.tracing builds the spans from these).
stages: contextvars.ContextVar[list | None] = contextvars.ContextVar("softmoe_stages", default=None)


def remaining() -> float:
    """Seconds left before the request's deadline (``inf`` outside a request)."""
    return deadline.get() - time.perf_counter()
