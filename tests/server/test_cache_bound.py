"""A load whose cache entry cannot get room fails as any failed load does: the serving version
stays and answers, nothing half-written is left, and the answer names the bytes the entry needed
and the bytes free. A real server (ONNX Runtime, the shipped digits) on a real small cache; the
tiny cap stands in for a full disk."""

from __future__ import annotations

import re
import shutil

import numpy as np
from fastapi.testclient import TestClient
from safetensors.numpy import load_file, save_file

from export import cache_space
from server.engine.defaults import SHIPPED
from server.http.app import create_app
from server.settings import Settings

INFER = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": [0.0] * 192}]}


def test_a_load_without_room_fails_naming_the_bytes_and_the_serving_version_stays(tmp_path, monkeypatch):
    repo, store = tmp_path / "models", tmp_path / "cache"
    shutil.copytree(SHIPPED / "digits", repo / "a")
    settings = Settings(model_repository=str(repo), model_control_mode="explicit", load_model=["a"],
                        backend="onnxruntime", cache_dir=str(store), grpc_port=0)
    with TestClient(create_app(settings)) as client:
        engine = client.app.state.engine
        served = {i.path for i in cache_space.items(store, in_use=True) if i.in_use}
        assert len(served) == 1  # the serving version holds its graphs
        weights = load_file(str(repo / "a" / "model.safetensors"))
        weights["head.bias"] = weights["head.bias"] + np.float32(1.0)
        save_file(weights, str(repo / "a" / "model.safetensors"), metadata={"format": "softmoe-package"})
        monkeypatch.setattr(cache_space, "_setting", "1000")  # --cache-max-size 1000: no entry fits
        r = client.post("/v2/repository/models/a/load")
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert re.search(r"needs [\d,]+ bytes; [\d,]+ bytes are free under the cache's cap of 1,000", error), error
        assert re.search(r"[\d,]+ bytes are free on the volume", error), error
        assert engine.status["a"].version == 1 and engine.status["a"].state == "READY"
        assert client.post("/v2/models/a/infer", json=INFER).status_code == 200
        leftovers = [p.name for r in cache_space.roots(store) if r.is_dir() for p in r.iterdir()
                     if p.name.startswith((".tmp-", ".bad-"))]
        assert leftovers == [] and {i.path for i in cache_space.items(store) if i.kind == "graph"} == served
        monkeypatch.setattr(cache_space, "_setting", None)  # room again: the default bound
        assert client.post("/v2/repository/models/a/load").status_code == 200
        assert engine.status["a"].version == 2
