"""Start-up says how each model is served, in one line a person can read: backend, device and
precision, the padded shapes, the threads, and whether calls run alone or beside each other, and
why. The proofs' own lines go to the debug log."""

from __future__ import annotations

import logging
import re

import pytest
from fastapi.testclient import TestClient

from server.engine import proof_cache
from server.http.app import create_app
from server.settings import Settings

# The shapes proven on this CPU: one list, or one per function where they differ (AVX2 torch proves
# digits-lit's image tower 2, 4, 8 and its text tower 1, 2, 4, 8); the full shape always.
_LIST = r"(?:[1248], )*8"
SHAPES = rf"padded shapes (?:{_LIST}|\w+ {_LIST}(?:; \w+ {_LIST})+) \(proven bitwise equal to 8\)"


# What a load did and where its time went, after how the model is served.
READY = (r"; ready after [0-9.]+ s \((?:graphs from the cache, )?proven: (?:hash [0-9.]+ s, )?session"
         r" [0-9.]+ s, proofs [0-9.]+ s, warm-up [0-9.]+ s\)")


@pytest.fixture(autouse=True)
def proofs_not_kept_yet(tmp_path, monkeypatch):
    """The shipped models' graphs come from the shared cache; their proofs from none, so every start proves."""
    monkeypatch.setattr(proof_cache, "root", lambda settings: tmp_path / "proofs")


def _start(caplog, **settings) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="softmoe"):
        with TestClient(create_app(Settings(**settings))):
            pass
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


@pytest.mark.parametrize("settings, want", [
    ({}, rf"onnxruntime on cpu \(fp32\); {SHAPES}; every batch alone with 2 intra-op threads "
         r"\(a batch of 8 takes [0-9.]+ ms, too short to share the cores\)"),
    ({"backend": "torch"}, rf"torch on cpu \(fp32\); {SHAPES}; one batch at a time with 2 intra-op threads"),
    ({"strict_determinism": False, "concurrent_batches": 1},
     r"onnxruntime on cpu \(fp32\); batches of 1 to 8 as they come \(--no-strict-determinism\); one batch at a time "
     r"with 2 intra-op threads"),
    ({"wide_lone_batches": False, "concurrent_batches": 2},
     rf"onnxruntime on cpu \(fp32\); {SHAPES}; 2 batches at once, 1 of the 2 intra-op threads each"),
])
def test_one_line_per_model(caplog, settings, want):
    lines = _start(caplog, threads=2, **settings)
    for name in ("digits", "digits-lit"):
        mine = [line for line in lines if line.startswith(f"{name}: ")]
        assert len(mine) == 1, lines
        assert re.fullmatch(rf"{name}: {want}{READY}", mine[0]), mine[0]


def test_the_proofs_speak_at_debug(caplog):
    _start(caplog, threads=2)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(line.startswith("digits/classify: padded shapes proven bitwise equal to 8") for line in debug), debug
    assert any("routing function's classify outputs are the plain one's, bitwise" in line for line in debug), debug
