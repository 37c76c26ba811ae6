"""The exported classifier behind Ray Serve: one replica, ``@serve.batch`` with
``--max-batch-size`` and ``batch_wait_timeout_s`` = ``--max-delay-ms``, Ray's HTTP proxy.

    python -m loadtests.peers.ray_app --onnx model.onnx --port 8002 [--max-batch-size 8]
                                      [--max-delay-ms 5] [--threads 2] [--max-ongoing-requests 128]
                                      [--session ort-defaults]

Starts a local Ray instance (no dashboard) and runs until SIGTERM, then shuts Serve and Ray down.
``POST /v1/classify`` with ``{"images": ["<base64>"]}``. ``max_ongoing_requests`` defaults to
`softmoe serve`'s ``--max-in-flight`` (128): Ray's own default (5) would keep batches of 8 from
ever filling. Decoding and preprocessing run in the replica's request handler.
"""

from __future__ import annotations

import signal
import threading

import numpy as np

from loadtests.peers.common import PeerModel, parser

try:
    from ray import serve
except ImportError as e:  # the bench checks this before starting the app
    raise SystemExit(f"ray[serve] is not installed: pip install 'softmoe-serve[peers]' ({e})") from None


@serve.deployment(num_replicas=1)
class Classifier:
    def __init__(self, onnx, name: str, threads: int, top_k: int, session: str, max_batch_size: int,
                 max_delay_ms: float) -> None:
        self.model = PeerModel(onnx, threads, top_k, session)
        self.name = name
        self.predict.set_max_batch_size(max_batch_size)
        self.predict.set_batch_wait_timeout_s(max_delay_ms / 1000)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)  # replaced in __init__ by the flags
    async def predict(self, pixels: list[np.ndarray]) -> list[dict]:
        logits = self.model.logits(np.stack(pixels))
        return [self.model.result(row) for row in logits]

    async def __call__(self, request) -> dict:
        pixels = self.model.pixels(await request.json())
        return {"model": self.name, "results": [await self.predict(pixels)]}


def main(argv: list[str] | None = None) -> None:
    import ray

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--max-ongoing-requests", type=int, default=128)
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = Classifier.options(max_ongoing_requests=args.max_ongoing_requests).bind(
            str(args.onnx), args.name, args.threads, args.top_k, args.session, args.max_batch_size, args.max_delay_ms)
        serve.run(app, name="peer", route_prefix="/v1/classify")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
