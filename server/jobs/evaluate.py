"""``softmoe eval PKG DATA --out DIR``: what a model scores on a user's labelled data.

Classifiers: top-1 and top-5 against the labels (each label mapped to the model's class of that
name, or, for an integer label such as a WebDataset ``cls``, to that class index), and per-class
top-1. Predictions are /v1/classify's (``server.pipeline.postprocess``).

Two-tower models: zero-shot classification against the class names (``--classnames``, else the
labels found: class folders, the manifest's labels), each the renormalised mean of its templates'
text embeddings (``--templates``, else the package's), scored as /v1/zero-shot scores them; and,
where samples carry texts, image->text and text->image recall@1/5/10 over the scored pairs (each
image's own text is its one match, as clip_benchmark's retrieval counts it).

DIR gets ``metrics.json``, ``summary.md``, ``predictions.jsonl`` (per scored sample: key, label,
the top-5) and ``confusion.png`` (classes found, up to 1,000). ``n`` counts the samples scored;
every sample that failed is in ``errors`` with its key and the reason.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from server.pipeline import postprocess as post
from server.jobs.data import Unit
from server.jobs.embed import image_vector, text_vector
from server.jobs.runner import JobError, ModelFacts, Outcome

RECALL_KS = (1, 5, 10)
CONFUSION_MAX_CLASSES = 1000
BLOCK = 1024  # rows of the similarity matrix held at once (retrieval, zero-shot)


class EvalSink:
    """Keeps what the metrics need: per classifier sample its top-5; per two-tower sample its image
    (and text) embedding, scored once every label is known."""

    def __init__(self, facts: ModelFacts, *, texts: bool) -> None:
        self.facts = facts
        self.classifier = facts.image_fn == "classify"
        self.texts = texts
        self.keys: list[str] = []
        self.labels: list[str | None] = []
        self.top5: list[list[int]] = []  # classifiers
        self.zimg: list[np.ndarray] = []  # two-tower
        self.ztxt: list[np.ndarray | None] = []

    def begin(self, unit: Unit) -> None:
        pass

    def end(self, unit: Unit) -> None:
        pass

    def add(self, unit: Unit, o: Outcome) -> None:
        if o.error is not None:
            return
        if self.classifier:
            if o.sample.label is None:
                o.error = "no label to score against"
                return
            scores = post.class_scores(o.image["logits"], self.facts.head_activation)
            self.top5.append([int(i) for i in post.top_indices(scores, 5)])
        else:
            self.zimg.append(image_vector(self.facts.image_fn, o.image))
            self.ztxt.append(text_vector(o.text) if o.text is not None else None)
        self.keys.append(o.sample.key)
        self.labels.append(o.sample.label)


def class_index(labels: list[str]) -> dict[str, int]:
    return {name: i for i, name in enumerate(labels)}


def map_label(label: str, names: dict[str, int], count: int) -> int | None:
    """A dataset label -> a class index: by name, else an integer label as the index itself."""
    if label in names:
        return names[label]
    text = label.strip()
    if text.lstrip("-").isdigit() and 0 <= int(text) < count:
        return int(text)
    return None


def _check_mapped(labels: list[str | None], names: dict[str, int], count: int, what: str) -> list[int]:
    targets, unknown = [], {}
    for label in labels:
        idx = map_label(label, names, count) if label is not None else None
        if idx is None:
            unknown[label] = unknown.get(label, 0) + 1
        targets.append(idx if idx is not None else -1)
    if unknown:
        shown = ", ".join(repr(k) for k in sorted(unknown, key=str)[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise JobError(f"{sum(unknown.values())} samples have labels {what} cannot map: {shown}{more}")
    return targets


def accuracy(top5: np.ndarray, targets: np.ndarray) -> tuple[float, float]:
    top1 = float(np.mean(top5[:, 0] == targets))
    top5_hit = float(np.mean((top5 == targets[:, None]).any(axis=1)))
    return top1, top5_hit


def per_class(pred: np.ndarray, targets: np.ndarray, names: list[str]) -> dict[str, dict]:
    out = {}
    for c in sorted(set(targets.tolist())):
        mask = targets == c
        out[names[c]] = {"n": int(mask.sum()), "top1": float(np.mean(pred[mask] == c))}
    return out


def recall_at(zimg: np.ndarray, ztxt: np.ndarray, ks=RECALL_KS) -> dict[str, dict[str, float]]:
    """Image->text and text->image recall@k of n pairs (row i's match is row i): a pair is found at
    k when fewer than k others score strictly higher. Float64, in blocks of rows."""
    a, b = zimg.astype(np.float64), ztxt.astype(np.float64)
    n = len(a)
    out = {}
    for name, (q, d) in (("image_to_text", (a, b)), ("text_to_image", (b, a))):
        ranks = np.empty(n, dtype=np.int64)
        for start in range(0, n, BLOCK):
            sims = q[start:start + BLOCK] @ d.T
            own = sims[np.arange(len(sims)), np.arange(start, start + len(sims))]
            ranks[start:start + len(sims)] = (sims > own[:, None]).sum(axis=1)
        out[name] = {f"R@{k}": float(np.mean(ranks < k)) for k in ks}
    return out


def score(sink: EvalSink, *, classnames: list[str] | None, templates: list[str] | None,
          run_texts) -> dict[str, Any]:
    """The metrics of what ``sink`` kept. ``run_texts(texts)`` embeds prompts through the text tower."""
    n = len(sink.keys)
    result: dict[str, Any] = {"n": n, "top1": None, "top5": None}
    if sink.classifier:
        names = sink.facts.labels or [str(i) for i in range(_num_classes(sink))]
        targets = np.array(_check_mapped(sink.labels, class_index(names), len(names), "the model"))
        top5 = _pad_top5(sink.top5)
        result["task"] = "classification"
        result["top1"], result["top5"] = accuracy(top5, targets)
        result["per_class"] = per_class(top5[:, 0], targets, names)
        result["_confusion"] = (targets, top5[:, 0], names)
        result["_pred"] = [[names[i] for i in row if i >= 0] for row in top5]
        return result
    tasks = []
    zimg = np.stack(sink.zimg) if sink.zimg else np.zeros((0, 1), np.float32)
    labelled = [i for i, label in enumerate(sink.labels) if label is not None]
    if labelled:
        names = classnames or sorted({sink.labels[i] for i in labelled})
        targets = np.array(_check_mapped([sink.labels[i] for i in labelled], class_index(names), len(names),
                                         "the class names"))
        zimg_l = zimg[labelled]
        n_l = len(labelled)
        if n_l != n:
            result["zero_shot_n"] = n_l
        templates = templates or sink.facts.templates
        limit = sink.facts.max_text_chars
        prompts = [[post.prompt(t, name) for t in templates] for name in names]
        long = next((p for ps in prompts for p in ps if len(p) > limit), None)
        if long is not None:
            raise JobError(f"the prompt {long[:40]!r}... has {len(long)} characters; the limit is {limit}")
        flat = [p for ps in prompts for p in ps]
        vecs = run_texts(flat)
        bad = next((v for v in vecs if isinstance(v, BaseException)), None)
        if bad is not None:
            raise JobError(f"the text tower failed on a prompt: {bad}")
        table = dict(zip(flat, (text_vector(v) for v in vecs)))
        zlab = np.stack([post.label_vector([table[p] for p in ps]) for ps in prompts]).astype(np.float32)
        top5 = np.full((n_l, min(5, len(names))), -1, dtype=np.int64)
        for start in range(0, n_l, BLOCK):
            scores = post.zero_shot_scores(zimg_l[start:start + BLOCK], zlab, sink.facts.logit_scale,
                                           sink.facts.logit_bias, "sigmoid")
            for i, row in enumerate(scores):
                top5[start + i] = post.zero_shot_order(row, names)[: top5.shape[1]]
        result["top1"], result["top5"] = accuracy(top5, targets)
        result["per_class"] = per_class(top5[:, 0], targets, names)
        result["classes"], result["templates"] = names, list(templates)
        result["_confusion"] = (targets, top5[:, 0], names)
        preds = {i: [names[j] for j in row] for i, row in zip(labelled, top5)}
        result["_pred"] = [preds.get(i, []) for i in range(n)]
        tasks.append("zero-shot")
    pairs = [i for i, t in enumerate(sink.ztxt) if t is not None]
    if pairs:
        result["recall"] = recall_at(zimg[pairs], np.stack([sink.ztxt[i] for i in pairs]))
        result["recall"]["n"] = len(pairs)
        tasks.append("retrieval")
    if not tasks:
        raise JobError("nothing to evaluate: the samples have no labels (class folders, a label column, cls "
                       "entries) and no texts (a text column, txt entries)")
    result["task"] = "+".join(tasks)
    return result


def _num_classes(sink: EvalSink) -> int:
    return int(sink.facts.dims["classify"].get("logits", 0))


def _pad_top5(rows: list[list[int]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=1)
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


# ------------------------------------------------------------------ outputs


def write_outputs(out: Path, metrics: dict[str, Any], sink: EvalSink) -> None:
    """metrics.json, predictions.jsonl, confusion.png and summary.md in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    confusion = metrics.pop("_confusion", None)
    preds = metrics.pop("_pred", None)
    if preds is not None:
        with open(out / "predictions.jsonl", "w") as f:
            for key, label, top in zip(sink.keys, sink.labels, preds):
                f.write(json.dumps({"key": key, "label": label, "top5": top}) + "\n")
    png = None
    if confusion is not None:
        png = confusion_png(out / "confusion.png", *confusion)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(metrics, png))


def confusion_png(path: Path, targets: np.ndarray, pred: np.ndarray, names: list[str]) -> str | None:
    """The confusion matrix of the classes present (rows: true, columns: predicted; a last column
    for predictions outside them), row-normalised; None (and no file) above 1,000 classes."""
    present = sorted(set(targets.tolist()))
    if not present or len(present) > CONFUSION_MAX_CLASSES:
        return None
    # heavy, an optional extra (jobs): matplotlib only where eval draws confusion.png
    import matplotlib

    matplotlib.use("Agg")  # a file, no display: chosen before pyplot (the same extra) is imported
    import matplotlib.pyplot as plt

    pos = {c: i for i, c in enumerate(present)}
    k = len(present)
    m = np.zeros((k, k + 1), dtype=np.int64)
    for t, p in zip(targets.tolist(), pred.tolist()):
        m[pos[t], pos.get(p, k)] += 1
    if not m[:, k].any():
        m = m[:, :k]
    rate = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
    side = min(24.0, max(4.0, 0.35 * k + 2))
    fig, ax = plt.subplots(figsize=(side + 1, side))
    im = ax.imshow(rate, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    labels = [names[c] for c in present]
    if k <= 40:
        ax.set_yticks(range(k), labels)
        ax.set_xticks(range(m.shape[1]), labels + (["other"] if m.shape[1] > k else []), rotation=90)
        if k <= 15:
            for i in range(k):
                for j in range(m.shape[1]):
                    if m[i, j]:
                        ax.text(j, i, str(m[i, j]), ha="center", va="center",
                                color="black" if rate[i, j] > 0.5 else "white", fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion matrix ({len(targets)} samples, rows normalised)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path.name


def _pct(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.2f}%"


def summary_markdown(m: dict[str, Any], png: str | None) -> str:
    lines = [f"# {m.get('model')}: {m.get('task')} on {m.get('data')}", "",
             f"- package `{m.get('package')}`, sha256 `{m.get('package_sha256')}`",
             f"- {m.get('backend')} on {m.get('device')} ({m.get('precision')}), "
             f"{m.get('images_per_second', 0):.1f} images/s",
             f"- scored: {m['n']}; failed: {len(m.get('errors', []))}", f"- command: `{m.get('command')}`", ""]
    if m.get("top1") is not None:
        lines += ["| top-1 | top-5 |", "|---|---|", f"| {_pct(m['top1'])} | {_pct(m['top5'])} |", ""]
    if "recall" in m:
        r = m["recall"]
        lines += [f"Retrieval over {r['n']} image-text pairs:", "", "| | " + " | ".join(f"R@{k}" for k in RECALL_KS) + " |",
                  "|---|" + "---|" * len(RECALL_KS)]
        for name in ("image_to_text", "text_to_image"):
            lines.append(f"| {name.replace('_', ' ')} | " + " | ".join(_pct(r[name][f'R@{k}']) for k in RECALL_KS) + " |")
        lines.append("")
    if m.get("per_class"):
        worst = sorted(m["per_class"].items(), key=lambda kv: (kv[1]["top1"], kv[0]))[:20]
        lines += ["Per class (the 20 lowest top-1):", "", "| class | n | top-1 |", "|---|---|---|"]
        lines += [f"| {name} | {v['n']} | {_pct(v['top1'])} |" for name, v in worst]
        lines.append("")
    if png:
        lines += [f"![confusion matrix]({png})", ""]
    errors = m.get("errors", [])
    if errors:
        lines += [f"Failed samples ({len(errors)}; all in metrics.json):", ""]
        lines += [f"- `{e['key']}`: {e['reason']}" for e in errors[:50]]
        lines.append("")
    return "\n".join(lines)
