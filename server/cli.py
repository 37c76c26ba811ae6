"""``softmoe serve``: every flag is also a SOFTMOE_* environment variable (flags win)."""

from __future__ import annotations

import argparse
import sys

from .settings import Settings

FLAGS = {  # flag -> (settings field, argparse kwargs)
    "--model": ("models", dict(action="append", metavar="[NAME=]PKG", help="package dir or exported .onnx; repeatable")),
    "--backend": ("backend", dict(choices=["torch", "onnxruntime", "tensorrt"])),
    "--device": ("device", dict(choices=["cpu", "cuda"])),
    "--precision": ("precision", dict(choices=["fp32", "fp16", "bf16"])),
    "--host": ("host", dict()),
    "--port": ("port", dict(type=int)),
    "--max-batch-size": ("max_batch_size", dict(type=int)),
    "--max-delay-ms": ("max_delay_ms", dict(type=float)),
    "--max-queue": ("max_queue", dict(type=int)),
    "--max-in-flight": ("max_in_flight", dict(type=int)),
    "--strict-determinism": ("strict_determinism", dict(action=argparse.BooleanOptionalAction)),
    "--threads": ("threads", dict(type=int)),
    "--decode-workers": ("decode_workers", dict(type=int)),
    "--request-timeout-s": ("request_timeout_s", dict(type=float)),
    "--max-body-bytes": ("max_body_bytes", dict(type=int)),
    "--max-images-per-request": ("max_images_per_request", dict(type=int)),
    "--max-texts-per-request": ("max_texts_per_request", dict(type=int)),
    "--max-image-pixels": ("max_image_pixels", dict(type=int)),
    "--label-cache-size": ("label_cache_size", dict(type=int)),
    "--cache-dir": ("cache_dir", dict()),
    "--drain-seconds": ("drain_seconds", dict(type=float)),
    "--warmup": ("warmup", dict(action=argparse.BooleanOptionalAction)),
    "--log-level": ("log_level", dict()),
}


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {field: getattr(args, field) for field, _ in FLAGS.values() if getattr(args, field, None) is not None}
    return Settings(**given)


def cmd_serve(args: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from .registry import ModelLoadError
    from .run import serve

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        err = e.errors()[0]
        print(f"error: {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        serve(settings)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve models over HTTP (see README for the endpoints)")
    for flag, (field, kwargs) in FLAGS.items():
        desc = Settings.model_fields[field].description or ""
        env = f"SOFTMOE_{field.upper()}"
        p.add_argument(flag, dest=field, default=None, **{"help": f"{kwargs.pop('help', desc)} [env {env}]", **kwargs})
    p.set_defaults(func=cmd_serve)
