"""Model outputs -> answers: the arithmetic /v1/classify, /v1/embed and /v1/zero-shot do after the
backend, shared with the dataset jobs (``softmoe eval``, ``softmoe embed``: server/jobs/) so both
give the same predictions and the same embedding bits for the same image."""

from __future__ import annotations

import math

import numpy as np


def class_scores(logits: np.ndarray, activation: str | None) -> np.ndarray:
    """One image's class scores, float64: sigmoid for sigmoid heads, else softmax."""
    logits = np.asarray(logits).astype(np.float64)
    if activation == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max())
    return e / e.sum()


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` best classes, best first; equal scores keep index order (/v1/classify's order)."""
    return np.argsort(-scores, kind="stable")[:min(k, len(scores))]


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """/v1/embed's normalisation of a classifier's pooled features (float32 in, float32 out)."""
    return v / (np.linalg.norm(v) + 1e-8)


def label_vector(prompt_vectors: list[np.ndarray]) -> np.ndarray:
    """A zero-shot label's embedding: the renormalised mean of its prompts' text embeddings."""
    mean = np.mean(prompt_vectors, axis=0)
    return mean / (np.linalg.norm(mean) + 1e-8)


def prompt(template: str, label: str) -> str:
    """A template with the label in its ``{}`` (or after it, when it has none)."""
    return template.replace("{}", label) if "{}" in template else f"{template} {label}"


def zero_shot_scores(zimg: np.ndarray, zlab: np.ndarray, scale: float | None, bias: float | None,
                     activation: str) -> np.ndarray:
    """(images, labels) scores. Per-pair products and exactly rounded sums: a label's score cannot
    depend on where it sits in the list (a BLAS matmul rounds differently by position)."""
    cos = (zimg.astype(np.float64)[:, None, :] * zlab.astype(np.float64)[None, :, :]).sum(-1)
    logits = (scale if scale is not None else 1.0) * cos + (bias or 0.0)
    if activation == "softmax":
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / np.array([[math.fsum(row)] for row in e])
    return 1 / (1 + np.exp(-logits))


def zero_shot_order(row: np.ndarray, labels: list[str]) -> list[int]:
    """Label indices best first; equal scores in label-name order (/v1/zero-shot's order)."""
    return sorted(range(len(labels)), key=lambda j: (-row[j], labels[j]))
