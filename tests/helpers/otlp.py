"""A real OTLP/HTTP trace receiver for tests: POST /v1/traces with a protobuf
ExportTraceServiceRequest (opentelemetry-proto decodes it), kept as flat span dicts."""

from __future__ import annotations

import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """``requests``: the exports posted (refused ones too, with ``fail``); ``spans``: one dict per span received (name, trace_id and span_id as hex, parent, times in
    ns, attributes, links as (trace_id, span_id) pairs, and its resource's attributes)."""

    def __init__(self, fail: bool = False) -> None:
        self.spans: list[dict] = []
        self.requests = 0
        self.fail = fail
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest, ExportTraceServiceResponse)

                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver._lock:
                    receiver.requests += 1
                if receiver.fail or self.path != "/v1/traces":
                    self.send_response(400 if receiver.fail else 404)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                receiver._add(request)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _add(self, request) -> None:
        with self._lock:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "kind": s.kind,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            "resource": resource})

    def trace(self, trace_id: str, want: set[str], timeout: float = 30.0) -> list[dict]:
        """The spans of ``trace_id``, once every name in ``want`` is among them."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if want <= {s["name"] for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


@contextlib.contextmanager
def otlp_receiver(fail: bool = False):
    receiver = Receiver(fail)
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
