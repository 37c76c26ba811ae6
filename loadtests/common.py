"""What the load test sends: configuration, served-model discovery, and request builders.

A request is built as plain bytes (``Call``) so that locust users and the runner's pre-flight
check send exactly the same bodies. Each endpoint rotates through the body forms the server
accepts: JSON with base64 images, ``multipart/form-data`` with image files, raw image bytes.

Environment variables (all optional)::

    LOADTEST_ENDPOINTS=classify,zero-shot,embed,oip   endpoints of the mixed locustfile
    LOADTEST_IMAGE_SIZES=digits,64x64,224x224,640x480 image groups (see loadtests.images)
    LOADTEST_IMAGE_FORMATS=png,jpeg                   encodings of the photos
    LOADTEST_IMAGES_PER_REQUEST=1,2,4                 images in one request (picked uniformly)
    LOADTEST_BODY_FORMS=json,multipart,raw            /v1 body forms (raw: one image only)
    LOADTEST_LABELS=zero,one,...,nine                 zero-shot candidate labels
    LOADTEST_OIP_BINARY=1                             OIP inputs as binary tensors (0: JSON data)
    LOADTEST_WAIT=0                                   seconds a user waits between requests
    LOADTEST_TIMEOUT=30                               per-request timeout, seconds
    LOADTEST_SEED=0                                   request randomness
    LOADTEST_CLASSIFIER, LOADTEST_TWO_TOWER           model names (default: discovered)
"""

from __future__ import annotations

import base64
import json
import os
import random
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .images import DEFAULT_FORMATS, DEFAULT_SIZES, Image, build_corpus, pixel_values

ENDPOINTS = ("classify", "zero-shot", "embed", "oip")
ALIASES = {"zero_shot": "zero-shot", "zeroshot": "zero-shot", "infer": "oip", "oip-infer": "oip"}
BODY_FORMS = ("json", "multipart", "raw")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _list(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def parse_endpoints(text: str) -> tuple[str, ...]:
    eps = tuple(ALIASES.get(e.lower(), e.lower()) for e in _list(text))
    bad = [e for e in eps if e not in ENDPOINTS]
    if bad or not eps:
        raise ValueError(f"unknown endpoint(s) {bad or text!r}; choose from {','.join(ENDPOINTS)}")
    return tuple(dict.fromkeys(eps))


@dataclass(frozen=True)
class Config:
    endpoints: tuple[str, ...] = ENDPOINTS
    image_sizes: tuple[str, ...] = DEFAULT_SIZES
    image_formats: tuple[str, ...] = DEFAULT_FORMATS
    images_per_request: tuple[int, ...] = (1, 2, 4)
    body_forms: tuple[str, ...] = BODY_FORMS
    labels: tuple[str, ...] = DIGIT_WORDS
    oip_binary: bool = True
    wait_s: float = 0.0
    timeout_s: float = 30.0
    seed: int = 0
    classifier: str | None = None
    two_tower: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> Config:
        env = dict(os.environ if env is None else env)
        d = cls()
        cfg = cls(
            endpoints=parse_endpoints(env["LOADTEST_ENDPOINTS"]) if env.get("LOADTEST_ENDPOINTS") else d.endpoints,
            image_sizes=_list(env.get("LOADTEST_IMAGE_SIZES", "")) or d.image_sizes,
            image_formats=_list(env.get("LOADTEST_IMAGE_FORMATS", "").lower()) or d.image_formats,
            images_per_request=tuple(int(n) for n in _list(env.get("LOADTEST_IMAGES_PER_REQUEST", ""))) or d.images_per_request,
            body_forms=_list(env.get("LOADTEST_BODY_FORMS", "").lower()) or d.body_forms,
            labels=_list(env.get("LOADTEST_LABELS", "")) or d.labels,
            oip_binary=env.get("LOADTEST_OIP_BINARY", "1").strip().lower() not in ("0", "false", "no"),
            wait_s=float(env.get("LOADTEST_WAIT", d.wait_s)),
            timeout_s=float(env.get("LOADTEST_TIMEOUT", d.timeout_s)),
            seed=int(env.get("LOADTEST_SEED", d.seed)),
            classifier=env.get("LOADTEST_CLASSIFIER") or None,
            two_tower=env.get("LOADTEST_TWO_TOWER") or None,
        )
        cfg = cls(**{**cfg.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        parse_endpoints(",".join(self.endpoints))
        if not self.images_per_request or any(n < 1 for n in self.images_per_request):
            raise ValueError("images per request must be positive")
        bad = [f for f in self.body_forms if f not in BODY_FORMS]
        if bad or not self.body_forms:
            raise ValueError(f"unknown body form(s) {bad}; choose from {','.join(BODY_FORMS)}")
        if not self.labels:
            raise ValueError("zero-shot needs at least one label")
        if self.wait_s < 0 or self.timeout_s <= 0:
            raise ValueError("wait must be >= 0 and timeout > 0")


# ---------------------------------------------------------------------------------- discovery


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """GET without any load-test bookkeeping (status 0 when the connection fails)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def http_post(url: str, body: bytes, headers: dict[str, str], timeout: float = 30.0) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
    except (urllib.error.URLError, OSError) as e:
        return 0, {}, str(e).encode()


@dataclass
class Served:
    """What the server says it serves: model kinds and the image tensor shape of each."""

    kinds: dict[str, str]  # model -> classifier | two-tower | encoder
    image_shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # model -> (C, H, W)
    info: list[dict] = field(default_factory=list)  # /v1/models entries

    def first(self, kind: str) -> str | None:
        return next((m for m, k in self.kinds.items() if k == kind), None)


def discover(base_url: str, timeout: float = 10.0) -> Served:
    base = base_url.rstrip("/")
    status, body = http_get(f"{base}/v1/models", timeout)
    if status != 200:
        raise RuntimeError(f"GET {base}/v1/models answered {status or 'no connection'}")
    data = json.loads(body)["data"]
    served = Served({m["id"]: m.get("kind", "") for m in data}, info=data)
    for name in served.kinds:
        status, body = http_get(f"{base}/v2/models/{name}", timeout)
        if status != 200:
            continue
        for t in json.loads(body).get("inputs", []):
            if t["name"] == "pixel_values" and len(t["shape"]) == 4:
                served.image_shapes[name] = tuple(int(x) for x in t["shape"][1:])
    return served


# ---------------------------------------------------------------------------------- requests


@dataclass
class Call:
    """One HTTP request, ready to send, and how to judge its answer."""

    endpoint: str  # classify | zero-shot | embed | oip (the stats name)
    path: str
    body: bytes
    headers: dict[str, str]
    images: int
    check: Callable[[int, dict, bytes], str | None]  # (status, headers, body) -> error or None
    group: str = ""  # image group of the first image


def _b64(img: Image) -> str:
    return base64.b64encode(img.data).decode()


def multipart(files: list[Image], fields: list[tuple[str, str]]) -> tuple[bytes, str]:
    boundary = "softmoe-" + uuid.uuid4().hex
    out = bytearray()
    for name, value in fields:
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n').encode()
    for img in files:
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="images"; filename="{img.name}"\r\n'
                f"Content-Type: {img.mime}\r\n\r\n").encode()
        out += img.data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def _status_error(status: int, body: bytes) -> str | None:
    if status == 200:
        return None
    text = body[:200].decode("utf-8", "replace")
    return f"HTTP {status or 'connection error'}: {text}"


def _json_check(k: int, extract: Callable[[dict], list], what: str, inner: Callable[[object], bool] | None = None):
    def check(status: int, headers: dict, body: bytes) -> str | None:
        err = _status_error(status, body)
        if err:
            return err
        try:
            items = extract(json.loads(body))
        except (ValueError, KeyError, TypeError) as e:
            return f"unexpected response body ({type(e).__name__}): {body[:120]!r}"
        if len(items) != k:
            return f"{len(items)} {what} for {k} images"
        if inner is not None and not all(inner(x) for x in items):
            return f"malformed {what}"
        return None

    return check


class Plan:
    """Builds ``Call`` objects for one server from a config, the image corpus and the served models."""

    def __init__(self, cfg: Config, served: Served) -> None:
        self.cfg = cfg
        self.served = served
        self.corpus = build_corpus(tuple(cfg.image_sizes), tuple(cfg.image_formats))
        self.groups = list(self.corpus)
        self.classifier = cfg.classifier or served.first("classifier")
        self.two_tower = cfg.two_tower or served.first("two-tower")
        self.embedders = [m for m, k in served.kinds.items() if k in ("classifier", "two-tower") and m in served.image_shapes]
        self.oip_models = [m for m in served.kinds if m in served.image_shapes]

    def problems(self) -> list[str]:
        """Why an endpoint of the config cannot be exercised on this server."""
        out = []
        need = {"classify": self.classifier, "zero-shot": self.two_tower,
                "embed": self.embedders, "oip": self.oip_models}
        what = {"classify": "a classifier", "zero-shot": "a two-tower model",
                "embed": "a model with an image tower", "oip": "a model with a pixel_values input"}
        for ep in self.cfg.endpoints:
            if not need[ep]:
                out.append(f"{ep}: the server serves no {what[ep]} (served: {self.served.kinds})")
        return out

    def images(self, rng: random.Random) -> list[Image]:
        k = rng.choice(self.cfg.images_per_request)
        return [rng.choice(self.corpus[rng.choice(self.groups)]) for _ in range(k)]

    def call(self, endpoint: str, rng: random.Random) -> Call:
        imgs = self.images(rng)
        build = {"classify": self._classify, "zero-shot": self._zero_shot, "embed": self._embed, "oip": self._oip}[endpoint]
        c = build(imgs, rng)
        c.group = imgs[0].group
        return c

    def _form(self, rng: random.Random, k: int, allowed: tuple[str, ...]) -> str:
        forms = [f for f in self.cfg.body_forms if f in allowed and (f != "raw" or k == 1)]
        return rng.choice(forms or ["json"])

    def _v1(self, endpoint: str, path: str, imgs: list[Image], fields: dict, rng, check, allowed=BODY_FORMS) -> Call:
        fields = {k: v for k, v in fields.items() if v is not None}
        form = self._form(rng, len(imgs), allowed)
        if form == "json":
            body = json.dumps({**fields, "images": [_b64(i) for i in imgs]}).encode()
            return Call(endpoint, path, body, {"Content-Type": "application/json"}, len(imgs), check)
        if form == "multipart":
            flat = [(k, v) for k, vs in fields.items() for v in (vs if isinstance(vs, list) else [vs])]
            body, ctype = multipart(imgs, [(k, str(v)) for k, v in flat])
            return Call(endpoint, path, body, {"Content-Type": ctype}, len(imgs), check)
        from urllib.parse import urlencode

        query = urlencode([(k, v) for k, vs in fields.items() for v in (vs if isinstance(vs, list) else [vs])])
        return Call(endpoint, f"{path}?{query}" if query else path, imgs[0].data, {"Content-Type": imgs[0].mime}, 1, check)

    def _classify(self, imgs, rng) -> Call:
        check = _json_check(len(imgs), lambda d: d["results"], "results", lambda r: bool(r["predictions"]))
        return self._v1("classify", "/v1/classify", imgs, {"model": self.classifier, "top_k": 3}, rng, check)

    def _zero_shot(self, imgs, rng) -> Call:
        n = len(self.cfg.labels)
        check = _json_check(len(imgs), lambda d: d["results"], "results", lambda r: len(r["scores"]) == n)
        # raw bodies would carry the labels in the query string: fine, but keep the URL short
        return self._v1("zero-shot", "/v1/zero-shot", imgs, {"model": self.two_tower, "labels": list(self.cfg.labels)},
                        rng, check, allowed=("json", "multipart"))

    def _embed(self, imgs, rng) -> Call:
        model = rng.choice(self.embedders)
        check = _json_check(len(imgs), lambda d: d["image_embeddings"], "embeddings", lambda v: len(v) > 0)
        return self._v1("embed", "/v1/embed", imgs, {"model": model}, rng, check)

    def _oip(self, imgs, rng) -> Call:
        model = rng.choice(self.oip_models)
        c, h, w = self.served.image_shapes[model]
        arr = np.stack([pixel_values(i, h, w) for i in imgs]).astype("<f4")
        if c != 3:
            arr = np.ascontiguousarray(arr[:, :1].repeat(c, axis=1))
        k = len(imgs)
        tensor = {"name": "pixel_values", "shape": list(arr.shape), "datatype": "FP32"}
        headers = {"Content-Type": "application/json"}
        if self.cfg.oip_binary:
            data = arr.tobytes()
            tensor["parameters"] = {"binary_data_size": len(data)}
            head = json.dumps({"inputs": [tensor]}).encode()
            body = head + data
            headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
        else:
            tensor["data"] = arr.reshape(-1).tolist()
            body = json.dumps({"inputs": [tensor]}).encode()

        def check(status: int, hdrs: dict, raw: bytes) -> str | None:
            err = _status_error(status, raw)
            if err:
                return err
            n = next((v for key, v in hdrs.items() if key.lower() == "inference-header-content-length"), None)
            try:
                payload = json.loads(raw[: int(n)] if n else raw)
                shapes = [o["shape"] for o in payload["outputs"]]
            except (ValueError, KeyError, TypeError) as e:
                return f"unexpected OIP response ({type(e).__name__}): {raw[:120]!r}"
            if not shapes or any(s[0] != k for s in shapes):
                return f"OIP output shapes {shapes} for {k} rows"
            return None

        return Call("oip", f"/v2/models/{model}/infer", body, headers, k, check)
