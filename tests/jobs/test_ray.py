"""``--ray auto``: the same jobs on Ray Data, on a local Ray cluster this test starts (``auto`` starts
one when none is running). The rows are a local run's, compared sorted by key, bit for bit; the
metrics are a local run's."""

from __future__ import annotations

import json

import pytest

from helpers import datasets
from helpers.datasets import DIGITS, LIT, softmoe, table as _table

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        datasets.env(mp)
        mp.delenv("RAY_ADDRESS", raising=False)
        yield datasets.build(tmp_path_factory.mktemp("data"), n=40)


@pytest.fixture(scope="module")
def ray_cluster(data):
    import ray

    yield
    ray.shutdown()


def test_embed_on_ray_gives_the_local_rows(data, tmp_path, ray_cluster):
    local, remote = tmp_path / "local", tmp_path / "ray"
    softmoe("embed", LIT, data.shards, "--out", local)
    softmoe("embed", LIT, data.shards, "--out", remote, "--ray", "auto")
    a, b = _table(local), _table(remote)
    assert a.num_rows == len([it for it in data.items if it.good])
    assert a.equals(b)  # every column, bitwise
    errors = [{"key": e["key"], "reason": e["reason"]} for e in map(json.loads, (remote / "_errors.jsonl").read_text().splitlines())]
    assert {e["key"] for e in errors} == data.bad("webdataset")
    assert sorted(p.name for p in remote.glob("*.parquet")) == sorted(p.name for p in local.glob("*.parquet"))
    # A rerun on Ray skips what is written, like a local one.
    stamp = {p.name: p.stat().st_mtime_ns for p in remote.glob("*.parquet")}
    softmoe("embed", LIT, data.shards, "--out", remote, "--ray", "auto")
    assert {p.name: p.stat().st_mtime_ns for p in remote.glob("*.parquet")} == stamp


@pytest.mark.parametrize("model", [DIGITS, LIT])
def test_eval_on_ray_gives_the_local_metrics(data, tmp_path, ray_cluster, model):
    local, remote = tmp_path / "local", tmp_path / "ray"
    softmoe("eval", model, data.manifest, "--out", local)
    softmoe("eval", model, data.manifest, "--out", remote, "--ray", "auto")
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (local, remote))
    for key in ("n", "top1", "top5", "per_class", "errors", "recall", "task"):
        assert a.get(key) == b.get(key), key
    assert (local / "predictions.jsonl").read_text() == (remote / "predictions.jsonl").read_text()
