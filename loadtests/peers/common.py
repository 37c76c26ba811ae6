"""What both peer apps share with `softmoe serve`: the exported graph and its metadata, the
server's own decode (``server.pipeline.decode``) and preprocess (``softmoe_models.preprocess``),
an ONNX Runtime session on the same intra-op threads, and the same top-k response body.

The session (``--session``): ``ort-defaults`` (default) is what a user of these servers writes,
``ort.InferenceSession(path, sess_options)`` with only the thread count set, so ONNX Runtime's own
defaults otherwise (full graph optimisation; the intra-op threads spin while they wait, and keep
spinning for a while after a run); ``softmoe`` is the session `softmoe serve` builds
(``export.runtime.ort_session`` with the server's default spin policy), which leaves only the front ends
to compare.

Requests are ``{"images": ["<base64>"]}`` with one image (what the bench sends to every server);
responses ``{"model": NAME, "results": [{"predictions": [{"label", "index", "score"}, ...]}]}``.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import numpy as np


SESSIONS = ("ort-defaults", "softmoe")


def parser(description: str) -> argparse.ArgumentParser:
    """The flags both apps take; the bench passes the values `softmoe serve` runs with."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--onnx", type=Path, required=True, help="the classifier graph exported by `softmoe export onnx`")
    p.add_argument("--name", default="model", help="model name in responses")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, required=True, help="as `softmoe serve` runs (the bench passes it)")
    p.add_argument("--max-delay-ms", type=float, required=True, help="as `softmoe serve` runs (the bench passes it)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: the CPUs available)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--session", choices=SESSIONS, default="ort-defaults",
                   help="ort-defaults: ONNX Runtime's defaults with the thread count set; softmoe: as `softmoe serve`")
    return p


class PeerModel:
    """The exported classifier: JSON body -> pixels, a batch of pixels -> logits, logits -> result."""

    def __init__(self, onnx_path: Path, threads: int = 0, top_k: int = 5, session: str = "ort-defaults") -> None:
        from export.onnx import read_metadata
        from softmoe_models.preprocess import PreprocessConfig

        meta = read_metadata(onnx_path)
        if meta.get("graph") != "classifier":
            raise ValueError(f"{onnx_path}: not a classifier graph (graph={meta.get('graph')!r})")
        self.preprocess = PreprocessConfig.from_dict(meta["preprocess"])
        self.labels = meta.get("labels")
        self.activation = (meta.get("package_config") or {}).get("head_activation") or "softmax"
        self.session = _session(onnx_path, threads, session)
        self.top_k = top_k

    def pixels(self, body: dict) -> np.ndarray:
        """``(3, S, S)`` float32 from the request's one base64 image, decoded as the server decodes."""
        from server.pipeline.decode import decode
        from softmoe_models.preprocess import preprocess_image

        data = base64.b64decode(body["images"][0])
        return preprocess_image(decode(data, self.preprocess.image_size, draft=self.preprocess.jpeg_draft), self.preprocess)

    def logits(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(["logits"], {"pixel_values": np.ascontiguousarray(batch)})[0]

    def result(self, logits: np.ndarray) -> dict:
        """One image's top-k, scored as ``Service.classify`` scores it."""
        z = logits.astype(np.float64)
        if self.activation == "sigmoid":
            scores = 1 / (1 + np.exp(-z))
        else:
            e = np.exp(z - z.max())
            scores = e / e.sum()
        idx = np.argsort(-scores, kind="stable")[: min(self.top_k, len(scores))]
        labels = self.labels or [str(i) for i in range(len(scores))]
        return {"predictions": [{"label": labels[i], "index": int(i), "score": float(scores[i])} for i in idx]}


def _session(onnx_path: Path, threads: int, kind: str):
    """The peer's InferenceSession on ``threads`` intra-op threads (0: ONNX Runtime's choice)."""
    import onnxruntime as ort

    if kind == "softmoe":
        from export.runtime import ort_session
        from server.settings import Settings

        spin = Settings.model_fields["ort_spinning"].default
        return ort_session(onnx_path, threads=threads or None, providers=["CPUExecutionProvider"], spin=spin)
    if kind != "ort-defaults":
        raise ValueError(f"unknown session {kind!r}: use one of {', '.join(SESSIONS)}")
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])
