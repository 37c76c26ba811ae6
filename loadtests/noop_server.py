"""The server's front end with a backend that does no model work: the bench's ``frontend`` section.

    python -m loadtests.noop_server --port 8000 [--image-size 224] [--num-classes 1000]
                                    [--max-batch-size 8] [--max-delay-ms 5]

Everything of `softmoe serve` runs (``server.http.app.create_app``: admission, body parsing, probe,
decode and preprocess in the decode pool, the batcher and its worker thread, padding to the
proven shapes, postprocess, metrics) except the model: the backend returns zeros of the right
shapes at once. One process, one uvicorn, configured as ``server/run.py`` configures it; the
bench starts one per port to measure how independent front-end processes scale. A front end of
several processes feeding one engine (shared memory) does not exist yet: this measures only the
front end's own cost.
"""

from __future__ import annotations

import argparse

import numpy as np

from server.backends.base import FunctionSpec, InputSpec, Rows


class NoopBackend:
    """``classify`` on ``(B, 3, S, S)`` float32: zero logits ``(B, K)`` and pre-logits ``(B, D)``, no work."""

    name = "noop"

    def __init__(self, *, image_size: int, num_classes: int, width: int, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.num_classes, self.width = num_classes, width
        pixels = InputSpec("pixel_values", (3, image_size, image_size), np.dtype(np.float32))
        self.functions = {"classify": FunctionSpec((pixels,), ("logits", "pre_logits"))}

    def run(self, fn: str, inputs: Rows) -> Rows:
        n = len(inputs["pixel_values"])
        return {"logits": np.zeros((n, self.num_classes), np.float32), "pre_logits": np.zeros((n, self.width), np.float32)}

    def warmup(self, batch_sizes: list[int]) -> None:
        pass

    def describe(self) -> dict:
        return {"backend": "noop", "device": "cpu", "precision": "fp32"}

    def close(self) -> None:
        pass


def noop_model(image_size: int = 224, num_classes: int = 1000, width: int = 384, max_batch_size: int = 8):
    """A ``ServedModel`` named ``noop``: a classifier with the usual preprocess contract and labels."""
    from server.engine.models import ServedModel
    from softmoe_models.preprocess import PreprocessConfig

    backend = NoopBackend(image_size=image_size, num_classes=num_classes, width=width, max_batch_size=max_batch_size)
    return ServedModel(name="noop", kind="classifier", source="noop", backend=backend,
                       preprocess=PreprocessConfig(image_size=image_size),
                       labels=[f"class_{i}" for i in range(num_classes)], head_activation="softmax")


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from server.http.app import create_app
    from server.settings import Settings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    defaults = Settings.model_fields  # the serve defaults, not a copy of them
    p.add_argument("--max-batch-size", type=int, default=defaults["max_batch_size"].default)
    p.add_argument("--max-delay-ms", type=float, default=defaults["max_delay_ms"].default)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    settings = Settings(host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                        max_delay_ms=args.max_delay_ms, log_level=args.log_level)
    model = noop_model(args.image_size, args.num_classes, max_batch_size=args.max_batch_size)
    app = create_app(settings, models=[model])
    # As server/run.py configures uvicorn (there the lifespan is entered before uvicorn starts).
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=max(30, settings.request_timeout_s + 5), access_log=False)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
