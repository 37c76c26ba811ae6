"""Hugging Face SigLIP -> package, against transformers itself (a test-only dependency).

Randomly initialised (and perturbed) SiglipModel directories of several shapes, odd ones included,
are converted with the real converter; token ids, pixel values, embeddings and logits are compared
with transformers' tokenizer, PIL-backend image processor and SiglipModel, for images sent as JPEG
and PNG files decoded by the server's decoder, in PyTorch and in ONNX Runtime (fused export).
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")

from server.pipeline.decode import decode  # noqa: E402  (the served decode path)
from softmoe_models.config import TwoTowerConfig, ViTConfig  # noqa: E402
from softmoe_models.convert import ConversionError, convert_checkpoint  # noqa: E402
from softmoe_models.package import load_model, read_package  # noqa: E402
from softmoe_models.preprocess import preprocess_image  # noqa: E402
from softmoe_models.tokenizer import Tokenizer  # noqa: E402

TOL = 1e-4  # fp32, the bound

# ------------------------------------------------------------------ reference directories


def pil_image_processor():
    """SiglipImageProcessor with the PIL backend (transformers 5 names it ...Pil; 4's default was PIL)."""
    import transformers

    return getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor


WORDS = ["cat", "dog", "car", "tree", "house", "bird", "boat", "apple", "photo", "picture", "image", "of", "a", "the",
         "an", "on", "with", "red", "blue", "small", "big", "café", "naïve", "straße", "日本", "東京", "ça", "über",
         "garçon", "résumé", "smørrebrød", "москва", "σίσυφος", "hello", "world", "what", "is", "this", "it's"]


def prompt_corpus(n: int = 320, seed: int = 0) -> list[str]:
    """Prompts with punctuation, case, unicode, odd whitespace, special-token texts and long ones."""
    fixed = [
        "", " ", "   ", "!!!", "a photo of a cat", "A Photo Of A CAT.", "Hello, World!", "it's (very) good...",
        "e-mail: foo@bar.com; #1 best 100%", 'quotes "x" and \'y\'', "{braces} [brackets] <angles>", "back\\slash",
        "under_score tilde~ caret^ pipe|", "¿qué? ¡sí!", "«guillemets» “smart” ‘quotes’", "em—dash – en-dash",
        "ellipsis… done", "UPPER CASE", "MiXeD CaSe", "İstanbul", "ΣΊΣΥΦΟΣ", "Straße ẞ", "Ǆemal ǅ", "ＡＢＣ ｆｕｌｌ",
        "e\u0301 combining", "a\u00a0b nbsp", "zero\u200bwidth", "tab\tnew\nline\r\nend", "  padded  ",
        "\u2581word mark", "mid\u2581mark", "日本語のテキスト", "emoji 😀🐱 here", "한국어 텍스트", "עברית", "العربية",
        "</s>", "a </s> b", "a</s>b", "<unk>", "x <unk> y", "</S> upper", "ends with eos </s>", " </s> ",
        "word " * 40, "punctuation, " * 30, "a" * 300, "🐱" * 80,
    ]
    rng = np.random.default_rng(seed)
    puncts = list(",.!?;:'\"()[]{}<>-_/\\@#$%^&*+=~`|") + ["...", "—", "…", "¿", "¡", "«", "»"]
    spaces = [" ", "  ", "\t", "\n", "\u00a0", "\u3000", " \u2581"]
    out = list(fixed)
    while len(out) < n:
        k = int(rng.integers(1, 14))
        parts = []
        for _ in range(k):
            w = WORDS[int(rng.integers(len(WORDS)))]
            r = rng.random()
            if r < 0.2:
                w = w.upper()
            elif r < 0.35:
                w = w.capitalize()
            if rng.random() < 0.3:
                w += puncts[int(rng.integers(len(puncts)))]
            parts.append(w)
            parts.append(spaces[int(rng.integers(len(spaces)))] if rng.random() < 0.25 else " ")
        out.append("".join(parts).strip() if rng.random() < 0.7 else "".join(parts))
    return out


@pytest.fixture(scope="session")
def spiece(tmp_path_factory) -> Path:
    """A SentencePiece model laid out as SigLIP's (pad 0, EOS 1, unk 2, no BOS); rare characters stay unknown."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("siglip-spm")
    corpus = root / "corpus.txt"
    lines = [p for p in prompt_corpus(400, seed=1) if p.strip()] + [" ".join(WORDS)] * 5
    corpus.write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / "spiece"), vocab_size=250,
                                   hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   model_type="unigram", character_coverage=0.995, minloglevel=2, num_threads=1)
    return root / "spiece.model"


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter off its init (zero biases, unit norms, zero logit scale and bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("logit_scale"):
                p.fill_(math.log(10.0) + 0.3)
            elif name.endswith("logit_bias"):
                p.fill_(-2.7)
            elif "norm" in name and name.endswith("weight"):
                p.mul_(1 + 0.2 * noise)
            else:
                p.add_(0.05 * noise)


# name: (vision, text, tokenizer max length). Odd widths, head counts (head dims 6, 8, 12), patch sizes
# 7 and 5, an image side that is not a multiple of the patch (30 / 7: the last 2 pixels are dropped),
# text and image widths that differ, a tokenizer length below the position table.
SHAPES = {
    "d48-p8": (dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                    patch_size=8),
               dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=16), 16),
    "d36-h3-p7-s30": (dict(hidden_size=36, intermediate_size=60, num_hidden_layers=1, num_attention_heads=3,
                           image_size=30, patch_size=7),
                      dict(hidden_size=30, intermediate_size=50, num_hidden_layers=2, num_attention_heads=5,
                           max_position_embeddings=20, projection_size=36), 12),
    "d40-h5-p5-l64": (dict(hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=5,
                           image_size=25, patch_size=5),
                      dict(hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                           max_position_embeddings=64, projection_size=40), 64),
}


def build_siglip(root: Path, spiece_file: Path, shape: str, *, seed: int = 0, separate_files: bool = False,
                 shard: bool = False, **tok_kw) -> Path:
    """A SiglipModel directory as `save_pretrained` writes it: config, weights, tokenizer, processor."""
    from transformers import SiglipConfig, SiglipModel, SiglipProcessor, SiglipTokenizer

    vision, text, max_len = SHAPES[shape]
    tok = SiglipTokenizer(vocab_file=str(spiece_file), model_max_length=max_len, **tok_kw)
    cfg = SiglipConfig(text_config=dict(vocab_size=tok.vocab_size, **text), vision_config=vision)
    torch.manual_seed(seed)
    model = SiglipModel(cfg).eval()
    _perturb(model, seed)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root, max_shard_size="40KB" if shard else "5GB")
    side = vision["image_size"]
    image_processor = pil_image_processor()(size={"height": side, "width": side})
    if separate_files:  # preprocessor_config.json + tokenizer files, as older hub snapshots
        image_processor.save_pretrained(root)
        tok.save_pretrained(root)
    else:
        SiglipProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(root)
    return root


def reference(src: Path):
    """transformers' model and processor, explicitly the PIL backend (what the package reproduces)."""
    from transformers import SiglipModel, SiglipProcessor, SiglipTokenizer

    model = SiglipModel.from_pretrained(src).eval()
    proc = SiglipProcessor(image_processor=pil_image_processor().from_pretrained(src),
                           tokenizer=SiglipTokenizer.from_pretrained(src))
    return model, proc


# ------------------------------------------------------------------ images as files


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def image_files(seed: int = 0) -> dict[str, bytes]:
    """JPEG and PNG files of several sizes and modes; one JPEG large enough for draft mode."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:120, 0:150]
    smooth = np.stack([(xx * 1.7) % 256, (yy * 2.1) % 256, ((xx + yy) * 0.9) % 256], -1).astype(np.uint8)
    noisy = rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)
    rgba = np.concatenate([noisy, rng.integers(0, 256, (45, 61, 1), dtype=np.uint8)], -1)
    return {
        "jpeg-rgb-large": _encode(Image.fromarray(smooth), "JPEG", quality=90),
        "jpeg-rgb-small": _encode(Image.fromarray(noisy[:20, :17]), "JPEG", quality=75),
        "jpeg-gray": _encode(Image.fromarray(smooth[..., 0]), "JPEG", quality=85),
        "png-rgb": _encode(Image.fromarray(noisy), "PNG"),
        "png-rgba": _encode(Image.fromarray(rgba, "RGBA"), "PNG"),
        "png-gray": _encode(Image.fromarray(noisy[..., 1]), "PNG"),
        "png-palette": _encode(Image.fromarray(smooth).convert("P", palette=Image.Palette.ADAPTIVE, colors=37), "PNG"),
        "png-exact-size": _encode(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "PNG"),
    }


def served_pixels(data: bytes, pkg) -> np.ndarray:
    """What the server feeds the model for an uploaded file: decode, then the package's preprocessing."""
    pre = pkg.preprocess
    return preprocess_image(decode(data, pre.image_size, draft=pre.jpeg_draft), pre)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def converted(tmp_path_factory, spiece):
    root = tmp_path_factory.mktemp("siglip")
    out = {}
    for i, shape in enumerate(SHAPES):
        src = build_siglip(root / f"hf-{shape}", spiece, shape, seed=i, separate_files=i == 1, shard=i == 2)
        pkg, notices = convert_checkpoint(src, root / f"pkg-{shape}")
        out[shape] = (src, pkg, notices)
    return out


PROMPTS = prompt_corpus(24, seed=5)[:4] + ["a photo of a cat", "the dog!", "CAFÉ au lait", "word " * 30]


# ------------------------------------------------------------------ token ids


def test_token_ids_match_transformers_on_hundreds_of_prompts(converted):
    from transformers import AutoTokenizer

    prompts = prompt_corpus(320)
    for shape, (src, pkg_dir, _) in converted.items():
        pkg = read_package(pkg_dir)
        ours = Tokenizer.from_contract(pkg.tokenizer_path, pkg.text)
        ref = AutoTokenizer.from_pretrained(src)
        with _quiet():
            want = ref(prompts, padding="max_length", truncation=True, return_tensors="np")
        got = ours(prompts)
        assert got.shape == want["input_ids"].shape == (len(prompts), pkg.text["max_len"]), shape
        bad = [p for p, g, w in zip(prompts, got, want["input_ids"]) if not np.array_equal(g, w)]
        assert not bad, f"{shape}: {len(bad)} prompts differ, e.g. {bad[:3]!r}"
        # usage counts = the tokens before padding = transformers' attention_mask
        assert [ours.count(p) for p in prompts] == want["attention_mask"].sum(-1).tolist()


@pytest.mark.parametrize("tok_kw", [dict(do_lower_case=False), dict(legacy=False)], ids=["cased", "legacy-false"])
def test_token_ids_other_tokenizer_settings(tmp_path, spiece, tok_kw):
    from transformers import AutoTokenizer

    src = build_siglip(tmp_path / "hf", spiece, "d48-p8", **tok_kw)
    pkg_dir, _ = convert_checkpoint(src, tmp_path / "pkg")
    pkg = read_package(pkg_dir)
    assert pkg.text["lowercase"] == ("none" if tok_kw.get("do_lower_case") is False else "unicode")
    prompts = prompt_corpus(120, seed=3)
    with _quiet():
        want = AutoTokenizer.from_pretrained(src)(prompts, padding="max_length", truncation=True, return_tensors="np")
    got = Tokenizer.from_contract(pkg.tokenizer_path, pkg.text)(prompts)
    assert np.array_equal(got, want["input_ids"])


class _quiet:
    """Silence transformers' 'sequence already has </s>' warning for prompts that end with it."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


# ------------------------------------------------------------------ pixels


def test_pixels_match_the_reference_processor(converted):
    for shape, (src, pkg_dir, _) in converted.items():
        pkg = read_package(pkg_dir)
        assert pkg.preprocess.jpeg_draft is False and pkg.preprocess.resize == "bicubic"
        proc = pil_image_processor().from_pretrained(src)
        for name, data in image_files().items():
            want = proc(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"][0]
            got = served_pixels(data, pkg)
            assert got.shape == want.shape, (shape, name)
            assert np.abs(got - want).max() <= 1e-6, (shape, name)


def test_draft_mode_would_break_parity(converted):
    """Why converted packages turn JPEG draft mode off: the large JPEG decodes to other pixels."""
    src, pkg_dir, _ = converted["d48-p8"]
    pkg = read_package(pkg_dir)
    data = image_files()["jpeg-rgb-large"]
    drafted = preprocess_image(decode(data, pkg.preprocess.image_size, draft=True), pkg.preprocess)
    assert np.abs(drafted - served_pixels(data, pkg)).max() > 1e-3


# ------------------------------------------------------------------ embeddings and logits


def _reference_outputs(src: Path, files: dict[str, bytes], prompts: list[str], mask: bool = True):
    model, proc = reference(src)
    images = [Image.open(io.BytesIO(b)) for b in files.values()]
    with _quiet():
        inputs = proc(text=prompts, images=images, padding="max_length", truncation=True, return_tensors="pt")
    if not mask:
        inputs.pop("attention_mask")
    with torch.no_grad():
        out = model(**inputs)
    return out.image_embeds.numpy(), out.text_embeds.numpy(), out.logits_per_image.numpy()


def _our_outputs(pkg_dir: Path, files: dict[str, bytes], prompts: list[str]):
    model = load_model(pkg_dir)
    pkg = model.package
    tok = Tokenizer.from_contract(pkg.tokenizer_path, pkg.text)
    pixels = torch.from_numpy(np.stack([served_pixels(b, pkg) for b in files.values()]))
    with torch.no_grad():
        zimg = model.encode_image(pixels)
        ztxt = model.encode_text(torch.from_numpy(tok(prompts)))
        logits = model.logits(zimg, ztxt)
    return zimg.numpy(), ztxt.numpy(), logits.numpy()


def _errors(got, want) -> dict[str, float]:
    return {k: float(np.abs(g - w).max()) for k, g, w in zip(("image_embeds", "text_embeds", "logits"), got, want)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_torch_parity(converted, shape):
    src, pkg_dir, _ = converted[shape]
    files = image_files()
    errs = _errors(_our_outputs(pkg_dir, files, PROMPTS), _reference_outputs(src, files, PROMPTS))
    print(f"\n{shape} torch max abs err: {errs}")
    assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("shape", list(SHAPES))
def test_onnx_export_parity(converted, shape, tmp_path):
    """The fused export (`softmoe export onnx`, verified against PyTorch) run in ONNX Runtime."""
    pytest.importorskip("onnxruntime")
    from export.onnx import export_onnx
    from export.runtime import ort_session

    src, pkg_dir, _ = converted[shape]
    written = export_onnx(pkg_dir, tmp_path / "m.onnx", towers="split", log=lambda *_: None)
    paths = {f.role: f.path for f in written}
    pkg = read_package(pkg_dir)
    files = image_files()
    pixels = np.stack([served_pixels(b, pkg) for b in files.values()])
    ids = Tokenizer.from_contract(pkg.tokenizer_path, pkg.text)(PROMPTS)
    zimg = ort_session(paths["image"]).run(["image_embeds"], {"pixel_values": pixels})[0]
    ztxt = ort_session(paths["text"]).run(["text_embeds"], {"input_ids": ids})[0]
    model = load_model(pkg_dir)
    logits = (model.logit_scale * torch.from_numpy(zimg) @ torch.from_numpy(ztxt).t() + model.logit_bias).numpy()
    errs = _errors((zimg, ztxt, logits), _reference_outputs(src, files, PROMPTS))
    print(f"\n{shape} onnxruntime max abs err: {errs}")
    assert max(errs.values()) <= TOL, errs


def test_padding_mask_switch(converted, tmp_path):
    """'off': the unmasked tower SigLIP was trained as = transformers given input_ids alone."""
    src, _, _ = converted["d48-p8"]
    masked = read_package(converted["d48-p8"][1])
    assert masked.config.text.padding_mask_id == 1 and "auto" in masked.meta["provenance"]["text_padding_mask"]
    off, _ = convert_checkpoint(src, tmp_path / "off", text_padding_mask="off")
    assert read_package(off).config.text.padding_mask_id is None
    files = {"png": image_files()["png-rgb"]}
    ours = _our_outputs(off, files, PROMPTS)
    assert max(_errors(ours, _reference_outputs(src, files, PROMPTS, mask=False)).values()) <= TOL
    assert np.abs(ours[1] - _reference_outputs(src, files, PROMPTS, mask=True)[1]).max() > 1e-3  # it matters


def test_package_contents(converted):
    src, pkg_dir, notices = converted["d36-h3-p7-s30"]
    meta = json.loads((pkg_dir / "config.json").read_text())
    assert meta["kind"] == "two-tower" and meta["provenance"]["format"] == "hf-siglip"
    assert meta["zero_shot_templates"] == ["{}"]
    assert meta["preprocess"]["image_size"] == 30 and meta["preprocess"]["value_range"] == [-1.0, 1.0]
    assert meta["text"]["max_len"] == 12 and (pkg_dir / "tokenizer.model").is_file()
    cfg = read_package(pkg_dir).config
    assert isinstance(cfg, TwoTowerConfig) and cfg.image.encoder.qk_norm is False and cfg.image.classifier == "map"
    assert cfg.image.grid == 4 and cfg.text.num_classes == 36 and cfg.text.encoder.hidden_size == 30
    assert any("first 12 of 20 position embeddings" in n for n in notices)
    model = load_model(pkg_dir)
    ref, _ = reference(src)
    assert math.isclose(float(model.logit_scale), float(ref.logit_scale.detach().exp()), rel_tol=1e-6)
    assert math.isclose(float(model.logit_bias), float(ref.logit_bias.detach()), rel_tol=1e-6)


# ------------------------------------------------------------------ vision-only


@pytest.mark.parametrize("prefixed", [False, True], ids=["v5-keys", "vision_model-prefix"])
def test_vision_model(tmp_path, prefixed):
    from safetensors.torch import load_file, save_file
    from transformers import SiglipVisionConfig, SiglipVisionModel

    vision, _, _ = SHAPES["d36-h3-p7-s30"]
    torch.manual_seed(3)
    ref = SiglipVisionModel(SiglipVisionConfig(**vision)).eval()
    _perturb(ref, 3)
    src = tmp_path / "hf"
    ref.save_pretrained(src)
    pil_image_processor()(size={"height": 30, "width": 30}, resample=2).save_pretrained(src)
    if prefixed:  # SiglipVisionModel checkpoints written before transformers 5 nest the keys
        state = load_file(str(src / "model.safetensors"))
        save_file({f"vision_model.{k}": v for k, v in state.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    pkg_dir, _ = convert_checkpoint(src, tmp_path / "pkg")
    pkg = read_package(pkg_dir)
    assert pkg.kind == "classifier" and isinstance(pkg.config, ViTConfig) and pkg.config.num_classes is None
    assert pkg.preprocess.resize == "bilinear"
    files = image_files()
    proc = pil_image_processor().from_pretrained(src)
    want_px = proc(images=[Image.open(io.BytesIO(b)) for b in files.values()], return_tensors="pt")["pixel_values"]
    got_px = torch.from_numpy(np.stack([served_pixels(b, pkg) for b in files.values()]))
    assert (got_px - want_px).abs().max() <= 1e-6
    with torch.no_grad():
        want = ref(pixel_values=want_px).pooler_output
        got = load_model(pkg_dir)(got_px)
    assert (got - want).abs().max() <= TOL


# ------------------------------------------------------------------ what is refused, in one line


def softmoe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    path.write_text(json.dumps(data))




BROKEN = {
    "other model type": (lambda d: _edit_json(d / "config.json", model_type="clip", architectures=["CLIPModel"]),
                         "model_type 'clip' is not supported"),
    "siglip2 naflex": (lambda d: _edit_json(d / "config.json", model_type="siglip2"), "siglip2"),
    "classification head": (lambda d: _edit_json(d / "config.json", architectures=["SiglipForImageClassification"]),
                            "SiglipForImageClassification"),
    "exact gelu": (lambda d: _edit_json(d / "config.json", **{"vision_config.hidden_act": "gelu"}), "hidden_act 'gelu'"),
    "eps": (lambda d: _edit_json(d / "config.json", **{"text_config.layer_norm_eps": 1e-5}), "layer_norm_eps"),
    "no head": (lambda d: _edit_json(d / "config.json", **{"vision_config.vision_use_head": False}), "vision_use_head"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "missing model.safetensors"),
    "no spiece": (lambda d: (d / "spiece.model").unlink(), "missing spiece.model"),
    "gemma tokenizer": (lambda d: _edit_json(d / "tokenizer_config.json", tokenizer_class="GemmaTokenizerFast"),
                        "Gemma tokenizer"),
    "no processor": (lambda d: (d / "processor_config.json").unlink(), "missing preprocessor_config.json"),
    "per-channel mean": (lambda d: _edit_json(d / "processor_config.json", **{"image_processor.image_mean": [0.4, 0.5, 0.6]}),
                         "per-channel normalisation"),
    "size mismatch": (lambda d: _edit_json(d / "processor_config.json", **{"image_processor.size": {"height": 24, "width": 24}}),
                      "differs from the model's image_size"),
    "weights mismatch": (lambda d: _edit_json(d / "config.json", **{"text_config.num_hidden_layers": 3}),
                         "missing 16 tensor(s): text_model.encoder.layers.2"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, spiece) -> Path:
    return build_siglip(tmp_path_factory.mktemp("pristine") / "hf", spiece, "d48-p8")


@pytest.mark.parametrize("case", list(BROKEN))
def test_unsupported_is_one_line(pristine, tmp_path, case):
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(pristine, src)
    edit, message = BROKEN[case]
    edit(src)
    with pytest.raises(ConversionError) as e:
        convert_checkpoint(src, tmp_path / "pkg")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli_converts_and_refuses_in_one_line(pristine, tmp_path):
    r = softmoe("convert", str(pristine), "--out", str(tmp_path / "pkg"))
    assert r.returncode == 0, r.stderr
    assert "two-tower" in r.stdout and "from hf-siglip" in r.stdout
    r = softmoe("convert", str(pristine / "model.safetensors"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pass the directory" in r.stderr


@pytest.mark.parametrize("kwargs, message", [
    (dict(labels=["cat", "dog"]), "no classifier head"),
    (dict(tokenizer="sp.model"), "the tokenizer is read from the directory"),
    (dict(text_pool="gap"), "pools the last position"),
    (dict(text_padding_mask="sometimes"), "not one of auto, on, off"),
])
def test_options_that_do_not_apply(pristine, tmp_path, kwargs, message):
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(pristine, tmp_path / "pkg", **kwargs)


def test_padding_mask_option_is_for_siglip_only(tmp_path):
    with pytest.raises(ConversionError, match="Hugging Face SigLIP directories only"):
        convert_checkpoint(tmp_path / "x.npz", tmp_path / "pkg", text_padding_mask="off")


def test_bf16_weights_are_cast_with_a_notice(pristine, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    shutil.copytree(pristine, src)
    state = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    pkg, notices = convert_checkpoint(src, tmp_path / "pkg")
    assert any("bfloat16 were cast to float32" in n for n in notices)
    got = load_model(pkg).text.head.weight
    assert torch.equal(got, state["text_model.head.weight"].to(torch.bfloat16).float())


# ------------------------------------------------------------------ the modules SigLIP added switches to


def test_single_query_attention_matches_sdpa_and_ignores_its_batch_slot():
    """The MAP head's one-query attention runs in explicit form: equal to SDPA within float32
    rounding, and a row's bits do not depend on where it sits in the batch (SDPA's CPU kernel did)."""
    import torch.nn.functional as F

    from softmoe_models.layers import Attention

    torch.manual_seed(0)
    attn = Attention(36, 3, qk_norm=False).eval()
    probe, tokens = torch.randn(1, 1, 36), torch.randn(1, 16, 36)
    with torch.no_grad():
        q, k, v = (attn._heads(f(x)).transpose(1, 2) for f, x in ((attn.q, probe), (attn.k, tokens), (attn.v, tokens)))
        sdpa = attn.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 1, 36))
        assert (attn(probe, kv=tokens) - sdpa).abs().max() <= 1e-6
        rows = []
        for slot in range(8):
            x, kv = torch.zeros(8, 1, 36), torch.zeros(8, 16, 36)
            x[slot], kv[slot] = probe[0], tokens[0]
            rows.append(attn(x, kv=kv)[slot])
    assert all(torch.equal(rows[0], r) for r in rows)


def test_padding_mask_keeps_the_eos_and_masks_the_pads():
    from softmoe_models.text import padding_mask

    ids = torch.tensor([[5, 6, 1, 1, 1], [5, 6, 7, 8, 1], [1, 1, 1, 1, 1], [5, 6, 7, 8, 9]])
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(padding_mask(ids, 1)[:, 0, 0], want)
