"""Server settings: every field is a `softmoe serve` flag and a ``SOFTMOE_*`` environment variable.

Precedence: command-line flag > environment variable > default.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from export.cache_space import parse_size
from softmoe_models.config import Precision


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SOFTMOE_", extra="forbid")

    models: list[str] = Field(
        default_factory=list,
        description="models to serve, each PKG or NAME=PKG (a package dir or an exported .onnx); "
        "env: SOFTMOE_MODELS as a JSON list; none: the built-in default model",
    )
    model_repository: str = Field(
        "", description="a folder of model packages, each folder a model named after it (Triton's model "
        "repository); served beside --model's",
    )
    model_control_mode: Literal["none", "explicit", "poll"] = Field(
        "none",
        description="none: load the whole repository at start, refuse load and unload requests; explicit: load "
        "the --load-model names at start, then take load and unload requests (/v2/repository/...); poll: load "
        "the whole repository, then rescan it every --repository-poll-s and load new or changed packages, "
        "unload removed ones",
    )
    load_model: list[str] = Field(
        default_factory=list,
        description="with --model-control-mode explicit: repository models to load at start (repeatable; '*': all)",
    )
    repository_poll_s: float = Field(15.0, gt=0, le=86_400, description="--model-control-mode poll: seconds between rescans")
    backend: Literal["auto", "torch", "onnxruntime", "tensorrt"] = Field(
        "auto",
        description="inference backend; auto: the fastest one verified equal on the device: onnxruntime on cpu "
        "(1.6x torch on soft-s16-e128, same answers; the export is cached and verified at first start; torch "
        "when onnxruntime is not installed), torch on cuda (CUDA graphs; the one GPU path gpu-check verifies "
        "end to end)",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="device the backend runs on")
    precision: Literal["auto", Precision] = Field(  # the precisions of `softmoe export`, plus auto
        "auto",
        description="compute precision; auto: fp32 on cpu; on cuda bf16 (torch, GPUs with native bf16) or fp16 "
        "(older GPUs, onnxruntime, tensorrt); LayerNorm, softmax and the Soft MoE norm stay fp32",
    )
    jpeg_draft: list[str] = Field(
        default_factory=list,
        description="served model names whose large JPEGs are decoded in DCT-domain draft mode (faster; pixels "
        "differ from a full decode, see the bench's decode section for the accuracy cost); '*': every model. "
        "Off by default; a package may also opt in with preprocess.jpeg_draft=true in its config.json",
    )
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="bind port")
    grpc_port: int = Field(
        8001, ge=0, le=65535,
        description="port of the Open Inference Protocol over gRPC (KServe v2; tritonclient.grpc) and the "
        "grpc.health.v1 service, as Triton's; 0: no gRPC",
    )
    max_batch_size: int = Field(8, ge=1, le=1024, description="images (or texts) per backend call")
    max_delay_ms: float = Field(5.0, ge=0, le=10_000, description="how long a batch waits to fill")
    eager_batching: bool = Field(
        True,
        description="an idle worker runs what is queued at once when no admitted request is still decoding "
        "for that model function (nothing known to be coming), so a lone request pays no --max-delay-ms; "
        "off: every batch waits up to --max-delay-ms to fill",
    )
    max_queue: int = Field(256, ge=1, description="queued items per model before requests get 429")
    max_in_flight: int = Field(128, ge=1, description="concurrent HTTP requests before new ones get 429 at the door")
    max_in_flight_bytes: int = Field(
        256 << 20, ge=1024,
        description="request body bytes reserved by the requests in flight (declared length at the door, "
        "counted as chunked bodies arrive); a request that does not fit gets 429",
    )
    strict_determinism: bool = Field(
        True,
        description="run every batch at one fixed padded shape so an item's outputs are bitwise "
        "independent of its batch-mates and of load",
    )
    proven_shapes: bool = Field(
        True,
        description="strict mode: at start-up, prove which padded shapes 1, 2, 4, ... below max_batch_size give "
        "bitwise the outputs of max_batch_size on this machine and backend, and run each batch at the smallest "
        "proven shape that holds it (no full padding at low load)",
    )
    threads: int = Field(0, ge=0, description="intra-op threads of the backend (0: the CPUs available)")
    concurrent_batches: int = Field(
        0, ge=0, le=64,
        description="batches the device runs at once, each by its own worker on the one copy of the model (CPU "
        "backends only); the intra-op threads are divided among them: more throughput at saturation where the "
        "model's threads scale poorly (with --wide-lone-batches a lone request keeps every thread). 0: 2 with "
        "onnxruntime on cpu, --wide-lone-batches and 2 or more intra-op threads, else 1",
    )
    wide_lone_batches: bool = Field(
        True,
        description="with --concurrent-batches N > 1 on onnxruntime on cpu: a batch that would run alone (no other "
        "call running, nothing more waiting) runs with every intra-op thread, and nothing starts beside it; full "
        "batches at load run N at once on the same session, sharing its threads, where start-up measures that this "
        "pays (--wide-lone-beside). A Soft MoE image model is served by its routing graph's one session (one copy "
        "of the weights). Functions without a routing graph always run alone, with every thread; off: every call "
        "has 1/N of the threads",
    )
    wide_lone_beside: Literal["auto", "always", "never"] = Field(
        "auto",
        description="--wide-lone-batches: whether full batches at load run beside each other (sharing the session's "
        "threads) or one at a time on every thread; auto: measured at start-up on the model's largest batch, beside "
        "where that serves 1.04x or more and a batch takes 20 ms or more",
    )
    decode_workers: int = Field(2, ge=1, description="threads decoding and preprocessing images")
    decode_nice: int = Field(
        0, ge=0, le=19,
        description="added to the decode threads' scheduling niceness (Linux; 0: the process's own). With a heavy "
        "model they then yield the cores to the backend's threads, which wait for their slowest peer at every "
        "parallel step (soft-s16-e128, 640x480 JPEGs, 10: +1-5% images/s in three runs); with a light one decode is the work "
        "(digits: -7% requests/s). docs/benchmarks.md",
    )
    decode_device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where JPEGs are decoded; cuda: nvJPEG via torchvision (opt-in: its pixels differ from "
        "Pillow's by a few levels, make gpu-check measures the top-1 agreement); needs a CUDA device and "
        "torchvision, else start-up fails; other formats, and JPEGs nvJPEG refuses, decode with Pillow (counted)",
    )
    request_timeout_s: float = Field(
        30.0, gt=0,
        description="deadline of a whole request, from its head: parsing, decoding and the queue (504 past it); the "
        "body gets 408 and the connection closed after this long spent waiting for its bytes; sending the response "
        "then gets as long again before a client that does not read is cut off",
    )
    header_timeout_s: float = Field(
        10.0, gt=0,
        description="time a client has to send a request's head (request line and headers) from the moment the "
        "connection opens or its previous response ends; past it the connection is closed (with a 408 when part "
        "of a head had arrived)",
    )
    min_body_rate: int = Field(
        65536, ge=0,
        description="bytes per second a request body must average over the time the server spends waiting for its "
        "bytes, after 2 s of grace; slower, it gets 408 and the connection is closed, so a client trickling a body "
        "holds its admission place for seconds, not for the whole request_timeout_s (0: only the deadline); a body "
        "the server already holds is never refused for time, however busy the server was",
    )
    max_connections: int = Field(
        0, ge=0,
        description="open connections before a new one gets a JSON 503 with Retry-After at once (0: the process's "
        "open-file limit less 256, at most 10000)",
    )
    max_header_bytes: int = Field(
        65536, ge=4096,
        description="request line and headers of one request, in bytes (431 and the connection closed above)",
    )
    max_body_bytes: int = Field(16 << 20, ge=1024, description="largest request body (413 above)")
    max_images_per_request: int = Field(64, ge=1, description="images in one request (422 above)")
    max_texts_per_request: int = Field(256, ge=1, description="texts or labels in one request (422 above)")
    max_text_chars: int = Field(1000, ge=1, description="characters in one text (422 above)")
    max_image_pixels: int = Field(
        16_777_216, ge=1,
        description="pixels one image may decode to (4096x4096; read from the file's header, 413 before decoding)",
    )
    max_request_pixels: int = Field(
        25_165_824, ge=1,
        description="pixels all images of one request may decode to together (413 before decoding)",
    )
    max_text_rows_per_request: int = Field(
        1024, ge=1,
        description="text rows one zero-shot request may run through the text tower (labels x templates; 422 above)",
    )
    label_cache_size: int = Field(4096, ge=0, description="zero-shot label embeddings kept (LRU)")
    cache_dir: str = Field("", description="where exported ONNX files are cached (default: ~/.cache/softmoe-serve)")
    cache_max_size: str = Field(
        "", description="the most the cache's entries may take: a size (20G, 512Mi, bytes) or a share of its volume "
        "(50%); the least recently used entries no loaded model uses are removed to stay under it. Default: 80% of "
        "the volume, keeping 10% of it free (export/cache_space.py says why); 100%: no bound",
    )
    drain_seconds: float = Field(2.0, ge=0, description="after SIGTERM: not-ready time before closing")
    warmup: bool = Field(True, description="run every batch shape once before reporting ready")
    cuda_graphs: bool = Field(
        True, description="torch on cuda: capture one CUDA graph per padded batch shape at warm-up and replay it",
    )
    pinned_staging: bool = Field(
        True, description="torch on cuda: stage inputs and outputs in pinned host buffers, async copies on the backend's own stream",
    )
    pixel_transfer: Literal["float32", "uint8"] = Field(
        "float32",
        description="how image rows reach the backend; uint8 (torch backend only): resized RGB bytes, mapped to the "
        "model's value range on the backend's device by a table lookup (bitwise the float32 path's values, a "
        "quarter of the bytes to stage and copy); the OIP image input is then 'pixels' UINT8 [N, S, S, 3] "
        "in place of 'pixel_values' FP32",
    )
    ort_spinning: Literal["run", "off"] = Field(
        "run",
        description="onnxruntime on cpu: run: the intra-op threads spin between the parallel steps of a batch and "
        "sleep once it is done (soft-s16-e128 on 2 cores: a lone request's p50 0.91x, throughput 0.97x within the "
        "spread; the same outputs); off: they sleep whenever they wait, leaving the cores to other work",
    )
    ort_cuda_graph: bool = Field(
        False, description="onnxruntime on cuda: CUDA-graph mode with I/O binding, every batch padded to max_batch_size",
    )
    routing: bool = Field(
        True, description="serve /v1/routing and routing statistics for Soft MoE image models (onnxruntime and "
        "tensorrt load one more graph per image model, with its own copy of the weights)",
    )
    routing_stats_sample: int = Field(
        16, ge=0, le=1_000_000,
        description="routing statistics from 1 in N backend calls of image traffic (0: off); a sampled call runs "
        "the routing graph instead of the plain one where start-up proved their outputs bitwise equal, else both",
    )
    routing_drift_window: int = Field(
        256, ge=1, le=1_000_000,
        description="sampled images in the live routing window compared with the package's reference routing profile",
    )
    frontend_workers: int = Field(
        0, ge=0, le=256,
        description="front-end processes (HTTP, parsing, decoding, preprocessing) sharing the port and feeding one "
        "engine process (the batcher and the backend: one per device) through shared memory; 0 or 1: one process "
        "does everything",
    )
    log_level: str = Field("info", description="uvicorn log level")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="json: every line of every process (uvicorn's, the engine's, the front ends') is one JSON "
        "object (timestamp, level, logger, message), and each request gets a line with its method, path or "
        "RPC, status, duration, request id, model and trace id",
    )
    api_key: SecretStr = Field(
        SecretStr(""),
        description="a key every inference, metadata and control request must send as 'Authorization: Bearer "
        "KEY' (HTTP and gRPC; 401 / UNAUTHENTICATED without it); health, readiness and /metrics stay open. "
        "Never logged; prefer --api-key-file or the environment over a flag (a flag shows in the process list)",
    )
    api_key_file: str = Field(
        "", description="a file of keys, one a line (blank lines and # comments skipped), any of them accepted "
        "beside --api-key; reread when it changes, for rotation",
    )
    otlp_endpoint: str = Field(
        "",
        description="OpenTelemetry traces over OTLP/HTTP (protobuf) to URL/v1/traces: a server span per request "
        "and a span per stage; the OTEL_* variables (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER...) are honoured. "
        "Empty: no tracing, at no cost",
    )
    trace_sample_ratio: float = Field(
        0.1, ge=0, le=1,
        description="--otlp-endpoint: the share of requests without a sampled W3C traceparent that start a "
        "trace (a sampled traceparent is always continued); OTEL_TRACES_SAMPLER, where set, replaces this",
    )

    @model_validator(mode="after")
    def _check_control(self):
        """Model control needs a repository; live loads need the engine in this process."""
        if self.model_control_mode != "none" and not self.model_repository:
            raise ValueError(f"--model-control-mode {self.model_control_mode} needs --model-repository DIR")
        if self.load_model and self.model_control_mode != "explicit":
            raise ValueError("--load-model names the models --model-control-mode explicit loads at start; the "
                             f"mode is {self.model_control_mode} (none and poll load the whole repository)")
        if self.model_control_mode != "none" and self.frontend_workers >= 2:
            raise ValueError(f"--model-control-mode {self.model_control_mode} changes models while serving, which "
                             "--frontend-workers >= 2 does not support (the front ends hold the models' descriptions); "
                             "use one process, or --model-control-mode none")
        return self

    @model_validator(mode="after")
    def _resolve_backend(self):
        """``auto`` becomes a concrete backend at once, so everything downstream (and the logs,
        metrics and /v2/models) names what really runs."""
        if self.backend == "auto":
            cpu_ort = self.device == "cpu" and importlib.util.find_spec("onnxruntime") is not None
            self.backend = "onnxruntime" if cpu_ort else "torch"
        if self.concurrent_batches == 0:  # auto, resolved here like the backend
            threads = self.threads or len(os.sched_getaffinity(0))
            wide = self.wide_lone_batches and self.device == "cpu" and self.backend == "onnxruntime"
            self.concurrent_batches = 2 if wide and threads >= 2 else 1
        return self

    @field_validator("cache_max_size")
    @classmethod
    def _cache_size(cls, value: str) -> str:
        parse_size(value)  # ValueError: one line naming the forms it takes
        return value

    @field_validator("models", "jpeg_draft", "load_model", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
        return value
