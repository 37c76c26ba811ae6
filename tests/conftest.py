"""Shared fixtures: where the golden vmoe data live, golden model packages converted by the real
converter, a SentencePiece tokenizer trained here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
GOLDEN = SHARED / "golden" / "vmoe"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers importable
# Servers the tests start (`softmoe serve` subprocesses inherit this) serve no gRPC unless a test
# gives them a free --grpc-port: several run at once, and none may take the well-known 8001.
os.environ.setdefault("SOFTMOE_GRPC_PORT", "0")


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


CAPTIONS = [f"{adj} {noun}" for adj in ("a photo of a", "the", "an image of a", "a picture of the", "one")
            for noun in ("cat", "dog", "car", "tree", "house", "bird", "boat", "zero", "one", "two", "three", "apple")]


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory):
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(CAPTIONS * 3) + "\n")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / "sp"), vocab_size=32, hard_vocab_limit=False,
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1, model_type="unigram",
                                   minloglevel=2, num_threads=1)
    return root / "sp.model"


@pytest.fixture(scope="session")
def packages(tmp_path_factory, tokenizer_file, golden_dir):
    root = tmp_path_factory.mktemp("served")
    from softmoe_models.convert import convert_checkpoint

    out = {}
    out["golden"], _ = convert_checkpoint(GOLDEN / "softmoe_e8p1.npz", root / "golden",
                                          labels=[f"label{i}" for i in range(10)])
    out["tt"], _ = convert_checkpoint(GOLDEN / "twotower.npz", root / "tt", text_pool="last")
    out["tt-tok"], _ = convert_checkpoint(GOLDEN / "twotower.npz", root / "tt-tok", tokenizer=tokenizer_file, text_pool="last")
    return out
