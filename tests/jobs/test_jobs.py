"""``softmoe eval`` and ``softmoe embed`` on real PNG and JPEG files, checked against the server:
every prediction is /v1/classify's or /v1/zero-shot's and every embedding is /v1/embed's, bit for
bit, for the same file, in each of the three dataset layouts; every bad file is reported by key."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from helpers import datasets
from helpers.live import live_server

ROOT, DIGITS, LIT, softmoe, _table = datasets.ROOT, datasets.DIGITS, datasets.LIT, datasets.softmoe, datasets.table
LAYOUTS = ("folder", "manifest", "webdataset")


@pytest.fixture(scope="module")
def limits():
    with pytest.MonkeyPatch.context() as mp:
        datasets.env(mp)
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory, limits) -> datasets.Layouts:
    return datasets.build(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def server(limits):
    from server.http.app import create_app
    from server.settings import Settings

    with live_server(create_app(Settings())) as url:  # the built-in models, default settings
        yield url


def fails(capsys, *argv: str) -> str:
    """Run a command that must stop with one ``error:`` line and status 2; returns the line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        softmoe(*argv)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err and err[-1].startswith("error: "), err
    return err[-1]


def spec(data: datasets.Layouts, layout: str) -> str:
    return {"folder": str(data.folder), "manifest": str(data.manifest), "webdataset": data.shards}[layout]


def key_of(data: datasets.Layouts, layout: str, it: datasets.Item) -> str:
    return {"folder": data.folder_key, "manifest": data.manifest_key, "webdataset": data.shard_key}[layout](it)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def served_images(url: str, model: str, items: list) -> list[list[float]]:
    """/v1/embed's image embeddings, one request per file (the photographs are large)."""
    return [post(url, "/v1/embed", {"model": model, "images": [b64(it.data)]})["image_embeddings"][0] for it in items]


def served_texts(url: str, model: str, texts: list[str]) -> list[list[float]]:
    return post(url, "/v1/embed", {"model": model, "texts": texts})["text_embeddings"]


# ------------------------------------------------------------------ eval


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eval_classifier_is_classify(data, server, tmp_path, layout):
    out = tmp_path / "out"
    softmoe("eval", DIGITS, spec(data, layout), "--out", out)
    metrics = json.loads((out / "metrics.json").read_text())
    good = [it for it in data.items if it.good]
    hits, served = 0, {}
    for it in good:
        preds = post(server, "/v1/classify", {"model": "digits", "images": [b64(it.data)], "top_k": 5})
        top = [p["label"] for p in preds["results"][0]["predictions"]]
        served[key_of(data, layout, it)] = top
        hits += top[0] == it.label
    assert metrics["n"] == len(good)
    assert metrics["top1"] == hits / len(good)
    assert 0.5 < metrics["top1"] < 1  # the photographs are not digits
    assert {e["key"] for e in metrics["errors"]} == data.bad(layout)
    assert all(e["reason"] for e in metrics["errors"])
    sources = {e["source"] for e in metrics["errors"]}
    if layout == "webdataset":  # the shard each came from
        assert sources <= {str(p) for p in data.shard_paths}
    else:  # the bad file itself
        root = data.folder if layout == "folder" else data.manifest.parent
        assert sources == {str(root / key) for key in data.bad(layout)}
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["key"]: r["top5"] for r in rows} == served
    assert metrics["package_sha256"] and metrics["command"].startswith("softmoe eval")
    assert (out / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert f"{100 * metrics['top1']:.2f}%" in summary and "confusion.png" in summary


def test_eval_zero_shot_and_retrieval(data, server, tmp_path):
    out = tmp_path / "out"
    softmoe("eval", LIT, data.manifest, "--out", out)
    metrics = json.loads((out / "metrics.json").read_text())
    good = [it for it in data.items if it.good]
    classes = sorted({it.label for it in good} | {it.label for it in data.items})
    assert metrics["classes"] == classes and metrics["task"] == "zero-shot+retrieval"
    hits, served = 0, {}
    for it in good:
        res = post(server, "/v1/zero-shot", {"model": "digits-lit", "images": [b64(it.data)], "labels": classes})
        top = [s["label"] for s in res["results"][0]["scores"]][:5]
        served[data.manifest_key(it)] = top
        hits += top[0] == it.label
    assert metrics["n"] == len(good) and metrics["top1"] == hits / len(good)
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["key"]: r["top5"] for r in rows} == served
    # Recall from the served embeddings: each image's own caption among all captions.
    img = np.array(served_images(server, "digits-lit", good), dtype=np.float64)
    txt = np.array(served_texts(server, "digits-lit", [it.text for it in good]), dtype=np.float64)
    sims = img @ txt.T
    rank = (sims > np.diag(sims)[:, None]).sum(1)
    for k in (1, 5, 10):
        assert metrics["recall"]["image_to_text"][f"R@{k}"] == pytest.approx(float(np.mean(rank < k)), abs=1e-12)
    assert {e["key"] for e in metrics["errors"]} == data.bad("manifest")


def test_eval_templates_and_classnames(data, tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("\n".join(datasets.WORDS) + "\n")  # integer labels (cls) name class i by line i
    out = tmp_path / "out"
    softmoe("eval", LIT, data.shards, "--out", out, "--classnames", names, "--templates", "the number {}",
            "a handwritten digit {}")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["classes"] == datasets.WORDS
    assert metrics["templates"] == ["the number {}", "a handwritten digit {}"]
    assert metrics["top1"] > 0.7


# ------------------------------------------------------------------ embed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_embed_is_v1_embed_bitwise(data, server, tmp_path, layout):
    out = tmp_path / "out"
    softmoe("embed", LIT, spec(data, layout), "--out", out)
    table = _table(out)
    rows = {r["key"]: r for r in table.to_pylist()}
    good = [it for it in data.items if it.good]
    assert set(rows) == {key_of(data, layout, it) for it in good}
    images, texts = served_images(server, "digits-lit", good), served_texts(server, "digits-lit", [it.text for it in good])
    for it, img, txt in zip(good, images, texts):
        row = rows[key_of(data, layout, it)]
        assert np.array_equal(np.array(row["image_embedding"], np.float32).view(np.uint32),
                              np.array(img, np.float32).view(np.uint32))
        if layout != "folder":  # folders carry no texts
            assert np.array_equal(np.array(row["text_embedding"], np.float32), np.array(txt, np.float32))
            assert row["text"] == it.text
        else:
            assert row["text"] is None and row["text_embedding"] is None
        assert row["label"] == it.label
    errors = [json.loads(line) for line in (out / "_errors.jsonl").read_text().splitlines()]
    assert {e["key"] for e in errors} == data.bad(layout)
    import pyarrow.parquet as pq

    assert pq.read_table(out).sort_by("key").equals(table)  # the directory reads as the shards alone
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["n"] == len(good) and summary["errors"] == len(data.bad(layout))


def test_embed_classifier_features(data, server, tmp_path):
    out = tmp_path / "out"
    softmoe("embed", DIGITS, data.folder, "--out", out)
    rows = {r["key"]: r for r in _table(out).to_pylist()}
    good = [it for it in data.items if it.good]
    for it, vec in zip(good, served_images(server, "digits", good)):
        assert np.array_equal(np.array(rows[data.folder_key(it)]["image_embedding"], np.float32),
                              np.array(vec, np.float32))
    assert "text_embedding" not in _table(out).schema.names


def test_embed_resumes(data, tmp_path, capsys):
    out = tmp_path / "out"
    softmoe("embed", LIT, data.shards, "--out", out)
    files = {p.name: p.read_bytes() for p in out.glob("*.parquet")}
    assert sorted(files) == ["train-000.parquet", "train-001.parquet", "train-002.parquet"]
    kept = out / "train-000.parquet"
    stamp = kept.stat().st_mtime_ns
    (out / "train-001.parquet").unlink()  # lost
    with open(out / "train-002.parquet", "ab") as f:  # changed after it was recorded: not trusted
        f.write(b"x")
    (out / ".train-001.parquet.tmp").write_bytes(b"half a shard")  # a run that stopped mid-shard
    capsys.readouterr()
    softmoe("embed", LIT, data.shards, "--out", out)
    assert "1 of 3 shards already written" in capsys.readouterr().err
    assert kept.stat().st_mtime_ns == stamp
    assert {p.name: p.read_bytes() for p in out.glob("*.parquet")} == files
    assert not list(out.glob(".*.tmp"))
    line = fails(capsys, "embed", DIGITS, data.shards, "--out", out)
    assert "another model sha256" in line


def test_unit_written_only_when_complete(data, tmp_path, monkeypatch, capsys):
    """--max-errors stops the job in its first shard: nothing is renamed into place or recorded."""
    out = tmp_path / "out"
    line = fails(capsys, "embed", LIT, data.shards, "--out", out, "--max-errors", "0")
    assert "more than --max-errors 0" in line
    assert not list(out.glob("*.parquet")) and not (out / "_shards.jsonl").exists()


# ------------------------------------------------------------------ one clear line


def test_user_errors_are_one_line(data, tmp_path, capsys):
    assert "more than --max-errors 2" in fails(capsys, "eval", DIGITS, data.folder, "--out", tmp_path / "a",
                                               "--max-errors", "2")
    (tmp_path / "empty").mkdir()
    assert "empty" in fails(capsys, "eval", DIGITS, tmp_path / "empty", "--out", tmp_path / "b")
    cats = tmp_path / "cats"
    (cats / "cat").mkdir(parents=True)
    (cats / "cat" / "a.png").write_bytes(data.items[0].data)
    assert "labels the model cannot map: 'cat'" in fails(capsys, "eval", DIGITS, cats, "--out", tmp_path / "c")
    assert "no such directory" in fails(capsys, "embed", DIGITS, tmp_path / "nothing", "--out", tmp_path / "d")
    assert "needs --out" in fails(capsys, "eval", DIGITS, data.folder)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.txt").write_text("no images here")
    assert "all 1 samples failed" in fails(capsys, "embed", DIGITS, junk, "--out", tmp_path / "e")
    bad = tmp_path / "m.csv"
    bad.write_text("file,label\na.png,1\n")
    assert "'path' column" in fails(capsys, "eval", DIGITS, bad, "--out", tmp_path / "f")


def test_missing_and_broken_shards_are_reported(data, tmp_path):
    broken = tmp_path / "wds"
    broken.mkdir()
    good = data.shard_paths[0].read_bytes()
    (broken / "s-000.tar").write_bytes(good)
    (broken / "s-001.tar").write_bytes(good[: len(good) // 2 + 100])  # truncated mid-entry
    out = tmp_path / "out"
    softmoe("eval", DIGITS, str(broken / "s-{000..002}.tar"), "--out", out)  # s-002.tar does not exist
    errors = {e["key"]: e["reason"] for e in json.loads((out / "metrics.json").read_text())["errors"]}
    assert errors[str(broken / "s-002.tar")] == "no such file"
    assert errors[str(broken / "s-001.tar")].startswith("unreadable shard")
