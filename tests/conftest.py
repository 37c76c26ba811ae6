"""Shared fixtures: where the golden vmoe data live, and small helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
GOLDEN = SHARED / "golden" / "vmoe"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers importable


def golden_npz(name: str) -> dict[str, np.ndarray]:
    path = GOLDEN / f"{name}.npz"
    if not path.is_file():
        pytest.skip(f"golden data not found at {path}")
    with np.load(path) as d:
        return {k: d[k] for k in d.files}


def golden_params(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[len("params/"):]: v for k, v in data.items() if k.startswith("params/")}


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not GOLDEN.is_dir():
        pytest.skip(f"golden data not found at {GOLDEN}")
    return GOLDEN
