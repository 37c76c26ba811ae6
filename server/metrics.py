"""Every metric of the server, in base units, with low-cardinality labels only.

Labels: model, stage, endpoint, status_class, reason; the routing statistics add layer (a Soft MoE
block index) and expert (an expert index): bounded by the model's architecture, layers x experts
series per model; the export cache's, kind (``CACHE_KINDS``). Never a request id or a label text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector

from export import cache_space

STAGES = ("decode", "preprocess", "queue", "inference", "postprocess", "total")
# Per-image latencies on CPU span ~1 ms (queue) to seconds (large models at batch 32).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Every reason a request is refused before (or instead of) inference. Each series exists from the
# first scrape at 0, so dashboards show 0 rather than "no data" and rate() works from the start.
REJECT_REASONS = (
    "too_many_connections",  # the open connection cap, before any request is read (503)
    "too_many_requests",  # the in-flight request cap, at the door (429)
    "body_budget",  # the in-flight body byte budget, at the door or while a chunked body arrives (429)
    "queue_full",  # the model's queue cannot take the request's items (429)
    "over_budget",  # a body, image or request over its size, pixel or text-row budget (413/422)
    "deadline",  # the request's deadline passed while decoding or queued (504)
    "cancelled",  # its client left: dropped before compute
    "client_disconnected",  # its client left while it waited
    "draining",  # shutting down (503)
    "slow_client",  # a head past header_timeout_s, a body under min_body_rate or past the deadline (408)
)
ENDPOINTS = ("classify", "embed", "zero_shot", "embeddings", "oip_infer", "grpc_infer", "routing")
# Normalised entropies lie in [0, 1] (1: uniform); trained Soft MoE routing sits mostly near the top.
ENTROPY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
# Loads span a cached tiny model (well under a second) to a first export of a large one (minutes).
LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DOOR = "none"  # the model label of refusals made before the model is known
# The export cache's kinds of entry (export.cache_space.KINDS), and builds under way.
CACHE_KINDS = (*cache_space.KINDS.values(), "build")


class Metrics:
    """A registry per app (tests build many apps in one process)."""

    def __init__(self) -> None:
        # Defined in this order, which is the order of the /metrics exposition.
        r = self.registry = CollectorRegistry()
        self._define_latencies(r)
        self._define_batching(r)
        self._define_admission(r)
        self._define_throughput(r)
        ProcessCollector(registry=r)  # process_* (RSS, CPU, start time, open fds)
        PlatformCollector(registry=r)  # python_info
        self._define_outcomes_and_backend(r)
        self._define_routing(r)
        self._define_model_loads(r)
        self._define_tracing(r)
        self._define_cache(r)

    def _define_latencies(self, r: CollectorRegistry) -> None:
        """Time per image (or text) in each stage, and per HTTP request."""
        self.image_latency = Histogram(
            "softmoe_image_latency_seconds", "Per-image (or per-text) time spent in each stage",
            ["model", "stage"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.request_duration = Histogram(
            "softmoe_request_duration_seconds", "HTTP request duration",
            ["model", "endpoint", "status_class"], buckets=LATENCY_BUCKETS, registry=r,
        )

    def _define_batching(self, r: CollectorRegistry) -> None:
        """What each backend call carries (items, padding) and what waits in the queues for one."""
        self.batch_size = Histogram(
            "softmoe_batch_size", "Real items per backend call (padding excluded)",
            ["model"], buckets=BATCH_BUCKETS, registry=r,
        )
        self.batch_padding_ratio = Histogram(
            "softmoe_batch_padding_ratio", "Fraction of each backend call that is padding",
            ["model"], buckets=(0.0, 0.125, 0.25, 0.5, 0.75, 0.875, 1.0), registry=r,
        )
        self.queue_depth = Gauge("softmoe_queue_depth", "Items waiting for the backend", ["model"], registry=r)
        self.queue_capacity = Gauge("softmoe_queue_capacity", "Items the model's queues admit", ["model"], registry=r)

    def _define_admission(self, r: CollectorRegistry) -> None:
        """Readiness and the door: connections, requests and refusals, the door's refusal
        series created at 0 (a model's own come with ``init_model``)."""
        self.server_ready = Gauge("softmoe_server_ready", "1 while /v2/health/ready answers 200 (0 while draining)",
                                  registry=r)
        self.in_flight = Gauge("softmoe_requests_in_flight", "HTTP requests being handled", registry=r)
        self.connections = Gauge("softmoe_connections_open", "HTTP connections open (--max-connections caps them)",
                                 registry=r)
        self.rejected = Counter(
            "softmoe_requests_rejected_total", "Requests refused before inference", ["model", "reason"], registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(DOOR, reason)

    def _define_throughput(self, r: CollectorRegistry) -> None:
        """Images (and texts) and backend calls processed, model readiness, GPU decode fallbacks."""
        self.images = Counter("softmoe_images_total", "Images (and texts) processed", ["model", "endpoint"], registry=r)
        self.model_ready = Gauge("softmoe_model_ready", "1 when the model is loaded and warmed up", ["model"], registry=r)
        self.batches = Counter("softmoe_batches_total", "Backend calls", ["model"], registry=r)
        self.gpu_decode_fallbacks = Counter(
            "softmoe_gpu_decode_fallbacks_total", "JPEGs nvJPEG refused (--decode-device cuda) and Pillow decoded",
            registry=r)

    def _define_outcomes_and_backend(self, r: CollectorRegistry) -> None:
        """Label cache lookups, body bytes in flight, error and response counts, the backend in use
        and whether its worker runs."""
        self.cache_hits = Counter(
            "softmoe_label_cache_total", "Zero-shot label embedding lookups", ["model", "result"], registry=r,
        )
        self.in_flight_bytes = Gauge("softmoe_requests_in_flight_bytes",
                                     "Request body bytes reserved by the requests in flight", registry=r)
        self.errors = Counter("softmoe_errors_total", "Error responses by type (the JSON error's type field)",
                              ["type"], registry=r)
        self.backend_info = Gauge(
            "softmoe_backend_info", "1 per served model: the backend, device, precision and execution provider "
            "actually in use", ["model", "backend", "device", "precision", "provider"], registry=r,
        )
        self.responses = Counter("softmoe_responses_total", "HTTP responses by status code (health and metrics "
                                 "excluded)", ["status"], registry=r)
        self.worker_alive = Gauge("softmoe_worker_alive", "1 while the device's batcher worker runs", registry=r)

    def _define_routing(self, r: CollectorRegistry) -> None:
        """Routing statistics of sampled image traffic (softmoe_models.routing;
        --routing-stats-sample), and the Sparse V-MoE drop counts."""
        self.routing_dispatch_entropy = Histogram(
            "softmoe_routing_dispatch_entropy", "Per sampled image and Soft MoE layer: the mean over slots of the "
            "entropy of a slot's dispatch weights over the tokens / log(tokens) (1: every slot averages all patches)",
            ["model", "layer"], buckets=ENTROPY_BUCKETS, registry=r,
        )
        self.routing_combine_entropy = Histogram(
            "softmoe_routing_combine_entropy", "Per sampled image and Soft MoE layer: the mean over tokens of the "
            "entropy of a token's combine weights over the slots / log(slots) (1: every token mixes all slots)",
            ["model", "layer"], buckets=ENTROPY_BUCKETS, registry=r,
        )
        self.routing_expert_share = Gauge(
            "softmoe_routing_expert_share", "Each expert's share of its layer's combine mass, mean over the live "
            "window of sampled images (sums to 1 over a layer's experts)", ["model", "layer", "expert"], registry=r,
        )
        self.routing_drift = Gauge(
            "softmoe_routing_drift", "Jensen-Shannon divergence (bits) of the live window's mean expert shares from "
            "the package's reference routing profile, averaged over layers", ["model"], registry=r,
        )
        self.routing_drift_baseline = Gauge(
            "softmoe_routing_drift_baseline", "The routing drift (bits) sampling noise alone gives an in-distribution "
            "window of the current size (from the reference profile's variances)", ["model"], registry=r,
        )
        self.routing_dropped_choices = Counter(
            "softmoe_routing_dropped_choices_total", "Sparse V-MoE: token choices that found no room in their expert "
            "(Experts Choice: tokens no expert took), over the images whose routing the server computed (sampled "
            "calls and /v1/routing); a dropped choice adds nothing but the residual", ["model", "layer"], registry=r,
        )
        self.routing_token_choices = Counter(
            "softmoe_routing_token_choices_total", "Sparse V-MoE: the token choices those drops are counted out of "
            "(tokens x experts per token per image): the drop rate is the ratio of the two rates",
            ["model", "layer"], registry=r,
        )
        self.routing_window_images = Gauge(
            "softmoe_routing_window_images", "Sampled images in the live routing window", ["model"], registry=r,
        )

    def _define_model_loads(self, r: CollectorRegistry) -> None:
        """Model loads by outcome, their duration and the time in each phase."""
        self.model_loads = Counter(
            "softmoe_model_loads_total", "Model loads (start-up and repository control), by outcome: success or "
            "failure (the serving version, if any, is untouched by a failure)", ["model", "outcome"], registry=r,
        )
        self.model_load_duration = Histogram(
            "softmoe_model_load_duration_seconds", "Time to load a model: package, backend, export or cache, "
            "proofs and warm-up, until it takes traffic", ["model"], buckets=LOAD_BUCKETS, registry=r,
        )
        self.model_load_phase_duration = Histogram(
            "softmoe_model_load_phase_duration_seconds", "Time a successful model load spent in each phase: hash "
            "(reading and checking files), export or bind (graphs built, or weights bound into a cached graph), "
            "session (the backend set up), proofs, warm-up", ["model", "phase"], buckets=LOAD_BUCKETS, registry=r,
        )

    def _define_tracing(self, r: CollectorRegistry) -> None:
        """--otlp-endpoint: spans handed to the OTLP exporter, by outcome (both 0 with tracing off)."""
        self.trace_spans_exported = Counter(
            "softmoe_trace_spans_exported_total", "Trace spans the OTLP exporter delivered", registry=r)
        self.trace_export_failures = Counter(
            "softmoe_trace_export_failures_total", "Trace spans the OTLP exporter could not deliver (the collector "
            "refused them or could not be reached after the exporter's retries)", registry=r)

    def _define_cache(self, r: CollectorRegistry) -> None:
        """The export cache (export.cache_space): its bytes, its bound and the volume's free space,
        as this process last measured them (at each load that reads or writes an entry, and each
        removal pass), and the entries removed to stay within the bound."""
        self.cache_bytes = Gauge(
            "softmoe_cache_bytes", "Bytes of the export cache's entries, by kind (graph, structure, proofs, engine; "
            "build: entries being written)", ["kind"], registry=r)
        self.cache_max_bytes = Gauge(
            "softmoe_cache_max_bytes", "The export cache's cap (--cache-max-size; default 80% of its volume)",
            registry=r)
        self.cache_free_bytes = Gauge(
            "softmoe_cache_free_bytes", "Bytes free on the export cache's volume", registry=r)
        self.cache_free_floor_bytes = Gauge(
            "softmoe_cache_free_floor_bytes", "The free space the export cache keeps on its volume by removing unused "
            "entries (10% of the volume, or what the cap leaves)", registry=r)
        self.cache_evictions = Counter(
            "softmoe_cache_evictions_total", "Export cache entries removed to stay within the bound (least recently "
            "used first, never one a loaded model uses), by kind", ["kind"], registry=r)
        for kind in cache_space.KINDS.values():
            self.cache_evictions.labels(kind)
        cache_space.watch(self.cache_seen)  # held weakly: it goes with this registry

    def cache_seen(self, usage: cache_space.Usage) -> None:
        """What the export cache measured (``cache_space.watch``): the gauges set, the removals counted."""
        for kind in CACHE_KINDS:
            self.cache_bytes.labels(kind).set(usage.bytes.get(kind, 0))
        self.cache_max_bytes.set(usage.limit.cap)
        self.cache_free_bytes.set(usage.free)
        self.cache_free_floor_bytes.set(usage.limit.floor)
        for kind, n in usage.evicted.items():
            if kind in cache_space.KINDS.values():  # a root of another name (a test's) is not the server's cache
                self.cache_evictions.labels(kind).inc(n)

    def init_model(self, model: str, functions: list[str] | tuple[str, ...] = ()) -> None:
        """Create every labelled series of ``model`` at 0 (counters) or empty (histograms)."""
        for reason in REJECT_REASONS:
            self.rejected.labels(model, reason)
        for endpoint in ENDPOINTS:
            self.images.labels(model, endpoint)
        for stage in STAGES:
            self.image_latency.labels(model, stage)
        for result in ("hit", "miss"):
            self.cache_hits.labels(model, result)
        self.batches.labels(model)
        self.batch_size.labels(model)
        self.batch_padding_ratio.labels(model)

    def init_routing(self, model: str, layers: list[int] | tuple[int, ...], experts: int, drift: bool) -> None:
        """Create the routing series of ``model``: histograms empty, shares and window at 0, and the
        drift gauges where the model has a reference profile."""
        for layer in layers:
            self.routing_dispatch_entropy.labels(model, str(layer))
            self.routing_combine_entropy.labels(model, str(layer))
            for e in range(experts):
                self.routing_expert_share.labels(model, str(layer), str(e)).set(0)
        self.routing_window_images.labels(model).set(0)
        if drift:
            self.routing_drift.labels(model).set(0)
            self.routing_drift_baseline.labels(model).set(0)

    def remove_model(self, model: str) -> None:
        """Remove every series labelled with ``model`` (it was unloaded), its load history excepted."""
        for metric in (self.image_latency, self.request_duration, self.batch_size, self.batch_padding_ratio,
                       self.queue_depth, self.queue_capacity, self.rejected, self.images, self.model_ready,
                       self.batches, self.cache_hits, self.backend_info, self.routing_dispatch_entropy,
                       self.routing_combine_entropy, self.routing_expert_share, self.routing_drift,
                       self.routing_drift_baseline, self.routing_dropped_choices, self.routing_token_choices,
                       self.routing_window_images):
            metric.remove_by_labels({"model": model})

    def init_errors(self, types: tuple[str, ...], statuses: tuple[int, ...]) -> None:
        for t in types:
            self.errors.labels(t)
        for status in statuses:
            self.responses.labels(str(status))
