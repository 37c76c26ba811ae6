"""The exported classifier behind LitServe: one API server process, one inference worker, batches
of up to ``--max-batch-size`` formed within ``--max-delay-ms`` (LitServe's ``batch_timeout``).

    python -m loadtests.peers.litserve_app --onnx model.onnx --port 8001 [--max-batch-size 8]
                                           [--max-delay-ms 5] [--threads 2] [--session ort-defaults]

``POST /v1/classify`` with ``{"images": ["<base64>"]}``; ``GET /health``. Decoding and
preprocessing run in ``decode_request`` (LitServe's inference worker, per request).
"""

from __future__ import annotations

import numpy as np

from loadtests.peers.common import PeerModel, parser

try:
    import litserve as ls
except ImportError as e:  # the bench checks this before starting the app
    raise SystemExit(f"litserve is not installed: pip install 'softmoe-serve[peers]' ({e})") from None


class OnnxClassifier(ls.LitAPI):
    def __init__(self, onnx, name: str, threads: int, top_k: int, session: str, **batching) -> None:
        super().__init__(api_path="/v1/classify", **batching)
        self.onnx, self.name, self.threads, self.top_k, self.session = onnx, name, threads, top_k, session

    def setup(self, device) -> None:
        self.model = PeerModel(self.onnx, self.threads, self.top_k, self.session)

    def decode_request(self, request: dict) -> np.ndarray:
        return self.model.pixels(request)

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.model.logits(x)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict:
        return {"model": self.name, "results": [self.model.result(output)]}


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    api = OnnxClassifier(args.onnx, args.name, args.threads, args.top_k, args.session, max_batch_size=args.max_batch_size,
                         batch_timeout=args.max_delay_ms / 1000)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=30)
    server.run(host=args.host, port=args.port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
