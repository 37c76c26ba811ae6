"""`softmoe train-demo`: the built-in default models, trained reproducibly on the CPU in minutes.

1. ``digits``: a small Soft MoE ViT classifier (8x8 input, patch 2 -> 16 tokens, MoE with 8
   experts x 1 slot in the last 2 of 4 blocks) on the training split.
2. ``digits-lit``: LiT. The classifier's tower, frozen (locked), as the image tower; a text tower
   trained with vmoe's SigLIP-style sigmoid loss on captions generated from the labels with
   varied templates, tokenized by a SentencePiece model trained on that caption corpus.

Reproducible: fixed seeds, one intra-op thread, deterministic algorithms, data in a fixed order.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import tempfile
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F

from ..config import EncoderConfig, MoEConfig, TextConfig, TwoTowerConfig, ViTConfig
from ..models import build_model
from .. import routing
from ..package import load_model, save_package
from ..tokenizer import Tokenizer
from .calibration import calibration_pixels
from .evaluate import evaluate_classifier, evaluate_zero_shot
from .data import (HELDOUT_TEMPLATES, LABELS, PREPROCESS, SERVING_TEMPLATES, TRAIN_TEMPLATES, WORDS, Split, caption,
                   load_splits)

IMAGE = ViTConfig(
    EncoderConfig(hidden_size=64, num_layers=4, num_heads=4, mlp_dim=128, qk_norm=True,
                  moe=MoEConfig(layers=(2, 3), num_experts=8, slots_per_expert=1)),
    image_size=8, patch_size=2, num_classes=10,
)
TEXT_LEN = 16


def _seed(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    return torch.Generator().manual_seed(seed)


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Augmentation: shift each image by up to one pixel (background = -1, the blank page)."""
    padded = F.pad(x, (1, 1, 1, 1), value=-1.0)
    out = torch.empty_like(x)
    offsets = torch.randint(0, 3, (x.shape[0], 2), generator=gen)
    for i, (dy, dx) in enumerate(offsets.tolist()):
        out[i] = padded[i, :, dy:dy + 8, dx:dx + 8]
    return out


def train_classifier(train: Split, seed: int, epochs: int, log=print) -> torch.nn.Module:
    gen = _seed(seed)
    model = build_model(IMAGE)
    with torch.no_grad():
        model.encoder.pos_embed.normal_(0, 0.02, generator=gen)
    x, y = torch.from_numpy(train.pixels), torch.from_numpy(train.targets)
    batch, steps_per_epoch = 64, math.ceil(len(y) / 64)
    total = epochs * steps_per_epoch
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    step = 0
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(y), generator=gen)
        for b in range(steps_per_epoch):
            idx = order[b * batch:(b + 1) * batch]
            for group in opt.param_groups:
                group["lr"] = 2e-3 * _cosine(step, total, warmup=total // 20 + 1)
            loss = F.cross_entropy(model(_shift(x[idx], gen)), y[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        if log and (epoch + 1) % max(1, epochs // 5) == 0:
            log(f"classifier epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}")
    return model.eval()


def caption_corpus() -> list[tuple[str, int]]:
    return [(caption(t, d), d) for t in TRAIN_TEMPLATES for d in range(10)]


def train_tokenizer(out_dir: Path) -> Path:
    """SentencePiece on the training captions (held-out templates excluded)."""
    model = io.BytesIO()  # in memory: no temp path ends up in the model's trainer spec
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([c for c, _ in caption_corpus()]), model_writer=model, vocab_size=96,
        hard_vocab_limit=False, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, num_threads=1,
        minloglevel=2, normalization_rule_name="identity", shuffle_input_sentence=False,
    )
    path = out_dir / "spm.model"
    path.write_bytes(model.getvalue())
    return path


def text_config(vocab: int) -> TextConfig:
    return TextConfig(EncoderConfig(hidden_size=64, num_layers=2, num_heads=4, mlp_dim=128, qk_norm=True),
                      vocab_size=vocab, max_len=TEXT_LEN, num_classes=IMAGE.encoder.hidden_size)


def train_lit(classifier: torch.nn.Module, train: Split, tokenizer: Tokenizer, seed: int, steps: int, log=print):
    """LiT: the classifier's tower frozen; text tower, ``s`` and ``b`` trained with the sigmoid loss."""
    gen = _seed(seed + 1)
    cfg = TwoTowerConfig(image=ViTConfig(IMAGE.encoder, image_size=8, patch_size=2, num_classes=None),
                         text=text_config(tokenizer.sp.get_piece_size()))
    model = build_model(cfg)
    state = {k: v for k, v in classifier.state_dict().items() if not k.startswith("head.")}
    model.image.load_state_dict(state)
    model.image.requires_grad_(False).eval()
    with torch.no_grad():
        model.text.encoder.pos_embed.normal_(0, 0.02, generator=gen)
        zimg_all = F.normalize(model.image(torch.from_numpy(train.pixels)), dim=-1)  # locked: computed once
    captions = caption_corpus()
    ids = torch.from_numpy(tokenizer([c for c, _ in captions]))
    cap_digit = torch.tensor([d for _, d in captions])
    img_digit = torch.from_numpy(train.targets)
    params = [p for n, p in model.named_parameters() if not n.startswith("image.")]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    batch = 64
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * _cosine(step, steps, warmup=steps // 20 + 1)
        model.text.train()
        bi = torch.randint(0, len(img_digit), (batch,), generator=gen)
        bt = torch.randint(0, len(captions), (batch,), generator=gen)
        ztxt = F.normalize(model.text(ids[bt]), dim=-1)
        logits = model.logit_scale * zimg_all[bi] @ ztxt.t() + model.logit_bias
        labels = torch.where(img_digit[bi, None] == cap_digit[None, bt], 1.0, -1.0)
        loss = -F.logsigmoid(labels * logits).sum(dim=1).mean()  # vmoe/SigLIP sigmoid loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log and (step + 1) % max(1, steps // 5) == 0:
            log(f"lit step {step + 1}/{steps}: loss {loss.item():.3f}, scale {model.logit_scale.item():.1f}, "
                f"bias {model.logit_bias.item():.2f}")
    return model.eval(), cfg


def train_demo(out: str | Path, seed: int = 0, epochs: int = 100, lit_steps: int = 1500, log=print) -> tuple[Path, Path]:
    """Train both models and write ``OUT/digits`` and ``OUT/digits-lit``; returns their paths."""
    out = Path(out)
    train, held = load_splits()
    log(f"data: {len(train.targets)} training and {len(held.targets)} held-out digits (index % 5 == 0)")
    classifier = train_classifier(train, seed, epochs, log)
    provenance = {"source": "softmoe train-demo", "format": "trained", "seed": seed, "epochs": epochs,
                  "lit_steps": lit_steps, "data": "sklearn.datasets.load_digits, held out: index % 5 == 0"}
    digits = save_package(classifier, IMAGE, out / "digits", labels=LABELS, preprocess=PREPROCESS,
                          provenance=provenance, extra={"demo": {"label_words": WORDS}})
    acc = evaluate_classifier(digits, held)
    _record(digits, {"heldout_top1": acc})
    log(f"digits: held-out top-1 {acc:.4f}")

    with tempfile.TemporaryDirectory() as tmp:
        spm_file = train_tokenizer(Path(tmp))
        tokenizer = Tokenizer(spm_file, TEXT_LEN)
        lit, cfg = train_lit(classifier, train, tokenizer, seed, lit_steps, log)
        lit_pkg = save_package(lit, cfg, out / "digits-lit", tokenizer=spm_file, preprocess=PREPROCESS,
                               provenance=provenance, extra={"zero_shot_templates": SERVING_TEMPLATES})
    zs = evaluate_zero_shot(lit_pkg, held, ["{}"], WORDS)
    serving = evaluate_zero_shot(lit_pkg, held, SERVING_TEMPLATES, WORDS)
    unseen = evaluate_zero_shot(lit_pkg, held, [t.replace("{w}", "{}").replace("{n}", "{}") for t in HELDOUT_TEMPLATES
                                                if "{w}" in t], WORDS)
    _record(lit_pkg, {"heldout_zero_shot_top1": serving, "heldout_zero_shot_top1_label_only": zs,
                      "heldout_zero_shot_top1_unseen_templates": unseen})
    log(f"digits-lit: held-out zero-shot top-1 {serving:.4f} (serving templates), {unseen:.4f} (unseen templates)")
    for pkg in (digits, lit_pkg):  # the drift reference, as `python -m softmoe_models.routing_cli profile PKG`
        _profile(pkg)
    return digits, lit_pkg


def _profile(pkg: Path) -> None:
    torch.manual_seed(0)
    pixels, source = calibration_pixels(pkg)
    routing.write_profile(pkg, routing.compute_profile(load_model(pkg), pixels, source))


def _record(pkg: Path, results: dict) -> None:
    cfg_file = pkg / "config.json"
    meta = json.loads(cfg_file.read_text())
    meta["eval"] = {k: round(v, 6) for k, v in results.items()}
    cfg_file.write_text(json.dumps(meta, indent=2) + "\n")


def copy_packages(src: Path, dst: Path) -> None:
    for name in ("digits", "digits-lit"):
        if (dst / name).exists():
            shutil.rmtree(dst / name)
        shutil.copytree(src / name, dst / name)
