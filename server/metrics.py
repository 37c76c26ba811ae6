"""Every metric of the server, in base units, with low-cardinality labels only.

Labels: model, stage, endpoint, status_class, reason. Never a request id or a label text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector

STAGES = ("decode", "preprocess", "queue", "inference", "postprocess", "total")
# Per-image latencies on CPU span ~1 ms (queue) to seconds (large models at batch 32).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """A registry per app (tests build many apps in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.image_latency = Histogram(
            "softmoe_image_latency_seconds", "Per-image (or per-text) time spent in each stage",
            ["model", "stage"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.request_duration = Histogram(
            "softmoe_request_duration_seconds", "HTTP request duration",
            ["model", "endpoint", "status_class"], buckets=LATENCY_BUCKETS, registry=r,
        )
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
        self.server_ready = Gauge("softmoe_server_ready", "1 while /v2/health/ready answers 200 (0 while draining)",
                                  registry=r)
        self.in_flight = Gauge("softmoe_requests_in_flight", "HTTP requests being handled", registry=r)
        self.rejected = Counter(
            "softmoe_requests_rejected_total", "Requests refused before inference", ["model", "reason"], registry=r,
        )
        self.images = Counter("softmoe_images_total", "Images (and texts) processed", ["model", "endpoint"], registry=r)
        self.model_ready = Gauge("softmoe_model_ready", "1 when the model is loaded and warmed up", ["model"], registry=r)
        self.batches = Counter("softmoe_batches_total", "Backend calls", ["model"], registry=r)
        ProcessCollector(registry=r)  # process_* (RSS, CPU, start time, open fds)
        PlatformCollector(registry=r)  # python_info
        self.cache_hits = Counter(
            "softmoe_label_cache_total", "Zero-shot label embedding lookups", ["model", "result"], registry=r,
        )
