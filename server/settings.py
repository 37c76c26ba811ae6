"""Server settings: every field is a `softmoe serve` flag and a ``SOFTMOE_*`` environment variable.

Precedence: command-line flag > environment variable > default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SOFTMOE_", extra="forbid")

    models: list[str] = Field(
        default_factory=list,
        description="models to serve, each PKG or NAME=PKG (a package dir or an exported .onnx); "
        "env: SOFTMOE_MODELS as a JSON list; none: the built-in default model",
    )
    backend: Literal["torch", "onnxruntime", "tensorrt"] = Field("torch", description="inference backend")
    device: Literal["cpu", "cuda"] = Field("cpu", description="device the backend runs on")
    precision: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="compute precision")
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="bind port")
    max_batch_size: int = Field(8, ge=1, le=1024, description="images (or texts) per backend call")
    max_delay_ms: float = Field(5.0, ge=0, le=10_000, description="how long a batch waits to fill")
    max_queue: int = Field(256, ge=1, description="queued items per model before requests get 429")
    max_in_flight: int = Field(128, ge=1, description="concurrent HTTP requests before new ones get 429 at the door")
    strict_determinism: bool = Field(
        True,
        description="run every batch at one fixed padded shape so an item's outputs are bitwise "
        "independent of its batch-mates and of load",
    )
    threads: int = Field(0, ge=0, description="intra-op threads of the backend (0: the CPUs available)")
    decode_workers: int = Field(2, ge=1, description="threads decoding and preprocessing images")
    request_timeout_s: float = Field(30.0, gt=0, description="deadline of a request in the queue")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="largest request body (413 above)")
    max_images_per_request: int = Field(64, ge=1, description="images in one request (422 above)")
    max_texts_per_request: int = Field(256, ge=1, description="texts or labels in one request (422 above)")
    max_text_chars: int = Field(1000, ge=1, description="characters in one text (422 above)")
    max_image_pixels: int = Field(40_000_000, ge=1, description="decoded pixels per image (413 above)")
    label_cache_size: int = Field(4096, ge=0, description="zero-shot label embeddings kept (LRU)")
    cache_dir: str = Field("", description="where exported ONNX files are cached (default: ~/.cache/softmoe-serve)")
    drain_seconds: float = Field(2.0, ge=0, description="after SIGTERM: not-ready time before closing")
    warmup: bool = Field(True, description="run every batch shape once before reporting ready")
    log_level: str = Field("info", description="uvicorn log level")

    @field_validator("models", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
        return value
