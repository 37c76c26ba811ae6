"""`softmoe eval PKG`: accuracy on the held-out digits (index % 5 == 0), through the served path."""

from __future__ import annotations

from pathlib import Path

import torch

from ..package import load_model, read_package
from ..tokenizer import Tokenizer
from .data import SERVING_TEMPLATES, WORDS, Split, load_splits


def evaluate_classifier(pkg: str | Path, held: Split) -> float:
    model = load_model(pkg)
    with torch.no_grad():
        pred = model(torch.from_numpy(held.pixels)).argmax(-1).numpy()
    return float((pred == held.targets).mean())


def label_embeddings(model, tokenizer: Tokenizer, labels: list[str], templates: list[str]) -> torch.Tensor:
    """Per label: the renormalised mean of its prompts' embeddings (what the server computes)."""
    out = []
    for label in labels:
        prompts = [t.replace("{}", label) if "{}" in t else f"{t} {label}" for t in templates]
        with torch.no_grad():
            z = model.encode_text(torch.from_numpy(tokenizer(prompts))).mean(0)
        out.append(z / (z.norm() + 1e-8))
    return torch.stack(out)


def evaluate_zero_shot(pkg: str | Path, held: Split, templates: list[str] | None = None, labels: list[str] = WORDS) -> float:
    meta = read_package(pkg)
    model = load_model(pkg)
    tokenizer = Tokenizer.from_contract(meta.tokenizer_path, meta.text)
    zlab = label_embeddings(model, tokenizer, labels, templates or meta.meta.get("zero_shot_templates") or SERVING_TEMPLATES)
    with torch.no_grad():
        zimg = model.encode_image(torch.from_numpy(held.pixels))
    pred = (zimg @ zlab.t()).argmax(-1).numpy()
    return float((pred == held.targets).mean())


def evaluate(pkg: str | Path) -> dict[str, float]:
    meta = read_package(pkg)
    _, held = load_splits()
    if meta.kind == "classifier":
        return {"heldout_top1": evaluate_classifier(pkg, held)}
    if meta.kind == "two-tower":
        if meta.tokenizer_path is None:
            raise ValueError(f"{pkg}: zero-shot evaluation needs a tokenizer in the package")
        return {"heldout_zero_shot_top1": evaluate_zero_shot(pkg, held)}
    raise ValueError(f"{pkg}: cannot evaluate a {meta.kind} package on the digits")
