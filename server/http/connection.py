"""The HTTP connection: uvicorn's httptools protocol with a deadline and a size limit on every
request head.

uvicorn bounds only the idle time between two requests of a keep-alive connection
(``timeout_keep_alive``), and drops that bound as soon as any byte arrives: a client that opens a
connection and sends nothing, or half a request line, or headers without end, holds its socket
(and the memory of what it sent) for as long as it likes. Here a head, the request line and its
headers, must be complete within ``header_timeout_s`` of the connection opening or of the previous
response ending, and must stay under ``max_header_bytes``. Past either, the connection is closed:
with a JSON 408 or 431 when part of a head had arrived, silently when nothing had (a client that
sent nothing is owed nothing, as at the keep-alive timeout). Both count in
``softmoe_requests_rejected_total{model="none"}`` (``slow_client``, ``over_budget``) and in the
response and error counters, like every other refusal.

The body and the response are bounded by the request's deadline in ``server.http.app.Observe``, where
the request is known. A head that arrives while an earlier request of the same connection is
still being answered (HTTP pipelining) is only size-bounded here: uvicorn stops reading once it is
complete, and the earlier request's own deadline bounds the wait. A refused pipelined head is
answered after the responses owed to the earlier requests, so the client reads them in order.

A connection opened while ``max_connections`` are open gets a JSON 503 with Retry-After at once
(``too_many_connections``), so that a flood of idle connections meets a fast refusal, not a
process out of file descriptors that stops accepting. Refusals close lingering: the answer, end
of stream, then whatever the client still sends is dropped for ``LINGER_S`` (``CAP_LINGER_S`` over
the connection cap, where the descriptors left are few), so that its request arriving at a closed
socket does not reset the connection before it has read the answer.

A response bigger than the kernel's socket buffers waits in the transport until the client reads
it; one still unread ``response_timeout_s`` after it was written (``softmoe serve`` passes
``request_timeout_s``) is dropped with the connection (``softmoe_errors_total{type="response_timeout"}``).
"""

from __future__ import annotations

import json
import logging
import resource
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.api.door import new_request_id_bytes
from server.errors import HeadersTooLarge, RequestTimeout, ServiceError, Unavailable
from server.metrics import DOOR, Metrics

log = logging.getLogger("softmoe.server")
LINGER_S = 2.0  # after a refusal: how long what the client still sends is read and dropped
CAP_LINGER_S = 0.25  # the same for a connection over max_connections (a request sent on connecting)


def default_max_connections() -> int:
    """The open-file limit less 256 descriptors for the process's own files, at most 10000."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(10000, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - 256))


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds this module describes. The bounds are class
    attributes, left unset here: :func:`bounded_protocol` makes the subclass that carries one
    server's values, and that subclass is what uvicorn builds a protocol of per connection."""

    parser_name = "httptools"
    header_timeout_s: float  # seconds a request head has to arrive complete
    max_header_bytes: int  # the most bytes a request head may take
    response_timeout_s: float  # seconds an unread response may wait in the transport
    max_connections: int  # the most connections open at once; one more is refused with 503
    metrics: Metrics  # where the connections, refusals and errors are counted
    limits: str  # the bounds in words, for the start-up line (server.run)
    _timer = None
    _waiting = False  # idle since the connection opened or the last response ended: the timer runs
    _started = False  # some byte of the awaited head has arrived
    _in_head = False  # between the start of a request line and the end of its headers
    _counted = 0  # the head's request line, header names and values, as parsed
    _raw = 0  # bytes of the chunks that arrived wholly inside the head (headers still being parsed)
    _refusing = False  # a head was refused: nothing more is read
    _deferred = None  # (error, reason) to answer once the earlier requests are answered
    _idle_since = 0.0  # loop time the last response ended

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.metrics.connections.set(len(self.connections))
        if len(self.connections) > self.max_connections:
            self._refuse(Unavailable(f"{self.max_connections} connections are open (max_connections); try again "
                                     "shortly"), "too_many_connections")
            return
        self._await_head()

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)
        self.metrics.connections.set(len(self.connections))

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            return
        if self._waiting and data:
            self._started = True
        inside = self._in_head
        super().data_received(data)
        if self._in_head and inside:  # httptools buffers a header until it ends: count the raw bytes too
            self._raw += len(data)
        limit = self.max_header_bytes
        if (self._counted > limit or self._raw > limit) and not self.transport.is_closing():
            self._refuse(HeadersTooLarge(f"request head over {limit} bytes (max_header_bytes)"), "over_budget")

    def on_message_begin(self) -> None:
        self._in_head, self._counted, self._raw = True, 0, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._counted += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._counted += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_timer()
        self._in_head = False
        if self._counted > self.max_header_bytes:  # refused in data_received once this chunk is parsed
            self._refusing = True
            return
        self._counted = self._raw = 0
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refusing:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refusing:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._deferred is not None:  # a refused pipelined head: answer it once the earlier ones are
            if not self._busy():
                self._answer(*self._deferred)
            return
        if self.timeout_keep_alive_task is not None:  # idle: uvicorn armed its keep-alive timer
            self._await_head()

    def _await_head(self) -> None:
        self._stop_timer()
        self._waiting, self._started = True, False
        self._idle_since = self.loop.time()
        self._timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _stop_timer(self) -> None:
        self._waiting = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.get_write_buffer_size():  # the last response is not read yet
            left = self._idle_since + self.response_timeout_s - self.loop.time()
            if left > 0:
                self._timer = self.loop.call_later(min(left, self.header_timeout_s), self._timed_out)
                return
            log.warning("dropping a connection whose client left %d response bytes unread for %g s",
                        self.transport.get_write_buffer_size(), self.response_timeout_s)
            self.transport.abort()  # close() would wait for the client to read
            self.metrics.errors.labels("response_timeout").inc()
            return
        if self.transport.is_closing():
            return
        if not self._started:  # nothing sent: close as the keep-alive timeout does
            self.transport.close()
            return
        self._refuse(RequestTimeout(f"the request head was not complete within {self.header_timeout_s:g} s "
                                    "(header_timeout_s)"), "slow_client")

    def _busy(self) -> bool:
        """An earlier request of this connection is still being answered (HTTP pipelining)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _refuse(self, error: ServiceError, reason: str) -> None:
        """Stop reading; answer ``error`` and close, after the responses owed to earlier requests
        (a pipelining client takes the responses in order)."""
        self._stop_timer()
        self._refusing = True
        if self._busy():
            self._deferred = (error, reason)
        else:
            self._answer(error, reason)

    def _answer(self, error: ServiceError, reason: str) -> None:
        """``error`` as JSON on the raw transport (no request exists for it), then close."""
        self._deferred = None
        body = json.dumps(error.body()).encode()
        given = dict(getattr(self, "headers", None) or ()).get(b"x-request-id", b"")[:128]
        rid = given if given and given.decode("latin-1").isprintable() else new_request_id_bytes()
        extra = b"".join(b"%s: %s\r\n" % (k.lower().encode(), v.encode()) for k, v in error.headers.items()
                         if k.lower() != "connection")
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"x-request-id: %s\r\n%sconnection: close\r\n\r\n"
                % (error.status, HTTPStatus(error.status).phrase.encode(), len(body), rid, extra))
        if not self.transport.is_closing():  # an earlier response may have closed the connection
            # A lingering close: the answer, then end of stream, then what the client still sends is
            # read and dropped for a moment, so its data arriving at a closed socket does not reset
            # the connection (and destroy the answer) before the client has read it.
            # Over the connection cap the linger is short: the descriptors past the cap are the few left.
            self.transport.write(head + body)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            linger = CAP_LINGER_S if reason == "too_many_connections" else LINGER_S
            self._timer = self.loop.call_later(linger, self.transport.close)
        self.metrics.rejected.labels(DOOR, reason).inc()
        self.metrics.responses.labels(str(error.status)).inc()
        self.metrics.errors.labels(error.type).inc()


def bounded_protocol(header_timeout_s: float, max_header_bytes: int, response_timeout_s: float,
                     max_connections: int, metrics: Metrics) -> type[HttpToolsProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``: a :class:`BoundedHeadProtocol`
    subclass that carries these bounds and counts in ``metrics``.

    Args:
        header_timeout_s: seconds a request head has, from the connection opening or the previous
            response ending, to arrive complete.
        max_header_bytes: the most bytes a request head may take.
        response_timeout_s: seconds a response may wait unread in the transport before the
            connection is dropped.
        max_connections: the most connections open at once.
        metrics: the server's metrics.
    """
    limits = f"heads within {header_timeout_s:g} s and {max_header_bytes} bytes, at most {max_connections} connections"
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,), {
        "header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes,
        "response_timeout_s": response_timeout_s, "max_connections": max_connections, "metrics": metrics,
        "limits": limits})
