"""The public HTTP interface, frozen: paths, methods, request content types, response codes and
the fields of every request/response schema. Regenerate deliberately with
``SOFTMOE_UPDATE_SNAPSHOT=1 pytest tests/server/test_openapi_snapshot.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from server.http.app import create_app
from server.settings import Settings

SNAPSHOT = Path(__file__).with_name("openapi.snapshot.json")


def summary(doc: dict) -> dict:
    paths = {}
    for path, ops in sorted(doc["paths"].items()):
        for method, op in sorted(ops.items()):
            body = op.get("requestBody", {}).get("content", {})
            paths[f"{method.upper()} {path}"] = {
                "request": sorted(body),
                "responses": sorted(op.get("responses", {})),
            }
    schemas = {name: sorted(s.get("properties", {})) for name, s in sorted(doc["components"]["schemas"].items())}
    return {"paths": paths, "schemas": schemas}


def test_openapi_matches_snapshot():
    doc = create_app(Settings()).openapi()  # the document needs no loaded model
    got = summary(doc)
    if os.environ.get("SOFTMOE_UPDATE_SNAPSHOT") or not SNAPSHOT.exists():
        SNAPSHOT.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(SNAPSHOT.read_text())
