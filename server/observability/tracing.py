"""OpenTelemetry traces of the requests a process serves (``--otlp-endpoint``), built after the fact.

A door (HTTP's Observe middleware, gRPC's ``Call``) asks :meth:`Tracing.begin` for the request's
server span: a W3C ``traceparent`` it carries is continued, otherwise ``--trace-sample-ratio``
decides, by a draw made before any span exists, so an unsampled request costs no span (or the
``OTEL_TRACES_SAMPLER`` the SDK reads decides, where set). Only a sampled
request records anything: ``server.context.stages`` becomes a list, and the service appends each
stage's perf_counter start and end to it (decode and preprocess per image, queue and inference per
backend call with the batch's id and size, postprocess). When the request is answered,
:meth:`Tracing.finish` turns those records into child spans named as the latency metric names the
stages (decode, preprocess, queue, inference, postprocess), with their recorded start and end
times, and ends the server span. Nothing is timed twice and no span is open while the request
runs.

A backend call serves several requests: it is one ``batch`` span (its own trace, always recorded,
made by the first sampled request that rode in it), and each sampled request's ``inference`` span
links to it (a span link), so the batch is neither copied into every trace nor a parent of any.

Spans go to ``URL/v1/traces`` over OTLP/HTTP (protobuf) from the SDK's batch processor, off the
request path; spans it could not deliver are counted (``softmoe_trace_export_failures_total``).
With ``--otlp-endpoint`` unset none of this is called and the SDK is not imported (the OTel API,
light, is): ``app.state.tracing`` is None.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import OrderedDict

from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from softmoe_models import __version__
from server.metrics import Metrics
from server.settings import Settings

STAGE_ORDER = ("decode", "preprocess", "queue", "inference", "postprocess")
BATCHES_KEPT = 4096  # batch span contexts remembered for the later requests of the same batch
SERVICE_NAME = "softmoe-serve"  # service.name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES say


def from_settings(settings: Settings, metrics: Metrics, exporter=None) -> Tracing | None:
    """The process's tracing, or None with ``--otlp-endpoint`` unset (and no ``exporter`` given:
    tests pass an in-memory one)."""
    if not settings.otlp_endpoint and exporter is None:
        return None
    return Tracing(settings, metrics, exporter)


class Tracing:
    """One tracer provider (per app: tests build many apps in one process) exporting over OTLP/HTTP."""

    def __init__(self, settings: Settings, metrics: Metrics, exporter=None) -> None:
        # the OTel SDK: only a process that traces (--otlp-endpoint) loads it
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_KEY, Resource
        # the OTel SDK too: --otlp-endpoint only
        from opentelemetry.sdk.trace import TracerProvider
        # the OTel SDK too: --otlp-endpoint only
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        # the OTel SDK too: --otlp-endpoint only
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

        if exporter is None:
            # the OTLP exporter (with the SDK): only with --otlp-endpoint and no exporter given
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint.rstrip("/") + "/v1/traces")
        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get(SERVICE_KEY, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_KEY: SERVICE_NAME}))
        # OTEL_TRACES_SAMPLER, where set, is the SDK's to read (sampler=None); else the flag's ratio.
        # With the flag's ratio, a request that carries no traceparent is a root, sampled at that
        # ratio by begin's own draw before any span object exists; the roots it keeps are all
        # recorded (ALWAYS_ON), and a caller's traceparent decides for the rest (ParentBased).
        sampler = None if os.environ.get("OTEL_TRACES_SAMPLER") else ParentBased(ALWAYS_ON)
        self._root_ratio = None if sampler is None else settings.trace_sample_ratio
        self.processor = BatchSpanProcessor(_Counted(exporter, metrics))
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("softmoe.server", __version__)
        # Batch spans: recorded whenever a sampled request rode the batch (the request already was sampled).
        self._batch_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        self._batch_provider.add_span_processor(self.processor)
        self._batch_tracer = self._batch_provider.get_tracer("softmoe.batcher", __version__)
        self._trace, self._propagator = trace, TraceContextTextMapPropagator()
        self._batches: OrderedDict[object, object] = OrderedDict()
        self._lock = threading.Lock()
        self._server_kind = trace.SpanKind.SERVER
        # perf_counter -> Unix nanoseconds; both clocks tick at the same rate over a request.
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def ns(self, perf: float) -> int:
        """A ``time.perf_counter()`` reading as Unix nanoseconds."""
        return int(perf * 1e9) + self._offset_ns

    def begin(self, name: str, traceparent: str | None, tracestate: str | None, start: float, attributes: dict):
        """The request's server span (not current anywhere; ended by :meth:`finish`). A sampled one
        records: ``span.is_recording()``. None for a request without a ``traceparent`` that the
        flag's ratio leaves unsampled: most requests, which so cost no span, ids or sampler call."""
        if not traceparent and self._root_ratio is not None and random.random() >= self._root_ratio:
            return None
        parent = None
        if traceparent:
            carrier = {"traceparent": traceparent}
            if tracestate:
                carrier["tracestate"] = tracestate
            parent = self._propagator.extract(carrier)
        return self.tracer.start_span(name, context=parent, kind=self._server_kind, start_time=self.ns(start),
                                      attributes=attributes)

    @staticmethod
    def trace_id(span) -> str:
        return f"{span.get_span_context().trace_id:032x}"

    def finish(self, span, records: list, end: float, attributes: dict, error: bool = False) -> None:
        """The stage spans from ``records`` (see server.context.stages), then the server span ends at ``end``."""
        parent = self._trace.set_span_in_context(span)
        request_id = attributes.get("softmoe.request_id", "")
        groups: dict[tuple, list] = {}
        for stage, model, start, stop, batch in records:
            groups.setdefault((stage, model, batch), []).append((start, stop))
        order = {s: i for i, s in enumerate(STAGE_ORDER)}
        for (stage, model, batch), times in sorted(groups.items(), key=lambda kv: (min(t[0] for t in kv[1]),
                                                                                  order.get(kv[0][0], 9))):
            start, stop = min(t[0] for t in times), max(t[1] for t in times)
            attrs = {"softmoe.model": model, "softmoe.request_id": request_id, "softmoe.items": len(times)}
            links = ()
            if batch is not None:
                batch_id, size = batch
                attrs["softmoe.batch_size"] = size
                if stage == "inference":
                    links = (Link(self._batch(batch_id, model, size, start, stop), {"softmoe.batch_id": batch_id}),)
            child = self.tracer.start_span(stage, context=parent, start_time=self.ns(start), attributes=attrs,
                                           links=links)
            child.end(end_time=self.ns(stop))
        span.set_attributes(attributes)
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=self.ns(end))

    def _batch(self, batch_id, model: str, size: int, start: float, stop: float):
        """The span context of the backend call ``batch_id``: made (and ended) by the first traced
        request of the batch, remembered for the others."""
        key = (model, batch_id)
        with self._lock:
            known = self._batches.get(key)
            if known is not None:
                return known
            span = self._batch_tracer.start_span("batch", start_time=self.ns(start), attributes={
                "softmoe.model": model, "softmoe.batch_size": size, "softmoe.batch_id": batch_id})
            span.end(end_time=self.ns(stop))
            self._batches[key] = context = span.get_span_context()
            while len(self._batches) > BATCHES_KEPT:
                self._batches.popitem(last=False)
            return context

    def close(self) -> None:
        """Export what is buffered, then stop the exporter."""
        self.provider.shutdown()


class _Counted:
    """The exporter, with the spans it could not deliver counted."""

    def __init__(self, inner, metrics: Metrics) -> None:
        self.inner, self.metrics = inner, metrics

    def export(self, spans):
        # the OTel SDK: loaded by Tracing.__init__ before any export
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - an exporter that raises is a failed export, not a dead thread
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.metrics.trace_spans_exported.inc(len(spans))
        else:
            self.metrics.trace_export_failures.inc(len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
