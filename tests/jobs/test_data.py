"""The dataset readers of ``softmoe eval`` / ``softmoe embed`` (server/jobs/data.py), without a model:
shard names, WebDataset keys, what each layout yields, and every way a sample or a shard is bad
turning into a sample with its reason (never a crash, never a silent skip)."""

from __future__ import annotations

import io
import tarfile

import pytest

from server.jobs.data import DataError, expand_braces, expand_shards, open_dataset, read_lines, split_entry


def test_brace_ranges_keep_padding_and_lists():
    assert expand_braces("s-{000..003}.tar") == [f"s-{i:03d}.tar" for i in range(4)]
    assert expand_braces("{a,b}/x-{8..10}.tar") == ["a/x-8.tar", "a/x-9.tar", "a/x-10.tar",
                                                     "b/x-8.tar", "b/x-9.tar", "b/x-10.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_webdataset_keys_split_at_the_first_dot():
    assert split_entry("dir/000123.jpg") == ("dir/000123", "jpg")
    assert split_entry("abc.seg.PNG") == ("abc", "seg.png")
    assert split_entry("noext") == ("noext", "")


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_shard_samples_and_their_errors(tmp_path):
    _tar(tmp_path / "a-0.tar", [("k1.jpg", b"x" * 10), ("k1.cls", b"3"), ("k1.txt", b"hello"),
                                ("k2.txt", b"no image"),
                                ("k3.png", b"y" * 5000),  # over the limit: never read
                                ("k4.webp", b"z"), ("k4.json", b'{"label": "cat", "caption": "a cat"}'),
                                ("k5.jpg", b"w"), ("k5.json", b"{not json")])
    ds = open_dataset(str(tmp_path / "a-{0..1}.tar"), 1000, tmp_path / "work")
    assert ds.kind == "webdataset" and [u.name for u in ds.units] == ["a-0", "a-1"]
    got = {s.key: s for s in ds.units[0].samples()}
    assert got["k1"].data == b"x" * 10 and got["k1"].label == "3" and got["k1"].text == "hello"
    assert got["k2"].error.startswith("no image entry") and got["k2"].text == "no image"
    assert "exceeds the limit of 1000 bytes" in got["k3"].error and got["k3"].data is None
    assert got["k4"].label == "cat" and got["k4"].text == "a cat" and got["k4"].data == b"z"
    assert got["k5"].error == "json entry is not valid JSON"
    missing = list(ds.units[1].samples())
    assert [(s.key, s.error) for s in missing] == [(str(tmp_path / "a-1.tar"), "no such file")]


def test_a_truncated_shard_keeps_what_it_read_and_says_so(tmp_path):
    _tar(tmp_path / "t.tar", [("a.jpg", b"1" * 600), ("b.jpg", b"2" * 600), ("c.jpg", b"3" * 600)])
    raw = (tmp_path / "t.tar").read_bytes()
    (tmp_path / "t.tar").write_bytes(raw[:1700])  # mid-way through b's data
    samples = list(open_dataset(str(tmp_path / "t.tar"), 10_000, tmp_path / "work").units[0].samples())
    assert samples[0].key == "a" and samples[0].error is None
    assert samples[-1].key == str(tmp_path / "t.tar") and samples[-1].error.startswith("unreadable shard")
    (tmp_path / "junk.tar").write_bytes(b"this is not a tar file at all" * 40)
    junk = list(open_dataset(str(tmp_path / "junk.tar"), 10_000, tmp_path / "work").units[0].samples())
    assert len(junk) == 1 and junk[0].error.startswith("unreadable shard")


def test_folders_and_manifests(tmp_path):
    (tmp_path / "f" / "cat" / "deep").mkdir(parents=True)
    (tmp_path / "f" / "dog").mkdir()
    (tmp_path / "f" / "cat" / "deep" / "a.png").write_bytes(b"a")
    (tmp_path / "f" / "dog" / "b.jpg").write_bytes(b"b")
    (tmp_path / "f" / "stray.png").write_bytes(b"c")
    ds = open_dataset(str(tmp_path / "f"), 100, tmp_path / "work")
    assert ds.classes == ["cat", "dog"]
    got = {s.key: s for u in ds.units for s in u.samples()}
    assert got["cat/deep/a.png"].label == "cat" and got["dog/b.jpg"].label == "dog"
    assert got["stray.png"].error == "a file outside any class folder"
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "x.png").write_bytes(b"x")
    assert [(s.key, s.label) for s in open_dataset(str(flat), 100, tmp_path / "work").units[0].samples()] == [("x.png", None)]

    m = tmp_path / "m.jsonl"
    m.write_text('{"path": "f/dog/b.jpg", "label": 1, "text": "a dog"}\n\n[1, 2]\nnot json\n{"label": "x"}\n')
    rows = list(open_dataset(str(m), 100, tmp_path / "work").units[0].samples())
    assert (rows[0].key, rows[0].label, rows[0].text, rows[0].error) == ("f/dog/b.jpg", "1", "a dog", None)
    assert [r.error for r in rows[1:]] == ["line 3 is not a JSON object", "line 4 is not JSON", "line 5 has no path"]
    with pytest.raises(DataError, match="'path' column"):
        (tmp_path / "bad.csv").write_text("file,label\n")
        open_dataset(str(tmp_path / "bad.csv"), 100, tmp_path / "work")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty"):
        open_dataset(str(tmp_path / "empty"), 100, tmp_path / "work")
    with pytest.raises(DataError, match="no such directory"):
        open_dataset(str(tmp_path / "nowhere"), 100, tmp_path / "work")


def test_shards_from_a_glob_and_unique_names(tmp_path):
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
        _tar(tmp_path / d / "s.tar", [("k.jpg", b"1")])
    shards = expand_shards(str(tmp_path / "*" / "s.tar"))
    assert shards == [str(tmp_path / "x" / "s.tar"), str(tmp_path / "y" / "s.tar")]
    assert [u.name for u in open_dataset(str(tmp_path / "*" / "s.tar"), 10, tmp_path / "work").units] == ["x__s", "y__s"]


def test_lists_from_files_or_literals(tmp_path):
    (tmp_path / "t.txt").write_text("a photo of {}\n\nthe {}\n")
    (tmp_path / "t.json").write_text('["x", "y"]')
    assert read_lines(str(tmp_path / "t.txt")) == ["a photo of {}", "the {}"]
    assert read_lines(str(tmp_path / "t.json")) == ["x", "y"]
    assert read_lines("a literal {}") == ["a literal {}"]


def test_manifest_units_are_byte_ranges_with_line_numbers_and_fingerprints(tmp_path, monkeypatch):
    import server.jobs.data as data

    monkeypatch.setattr(data, "FILES_PER_UNIT", 2)
    m = tmp_path / "m.csv"
    m.write_text('path,label,text\na.png,1,"one\nline two"\n\nb.png,2,x\nc.png,3,y\n,4,z\nd.png,5,"q ""quoted"""\n')
    ds = open_dataset(str(m), 100, tmp_path / "work")
    assert [u.name for u in ds.units] == ["part-00000", "part-00001", "part-00002"] and ds.count == 5
    rows = [s for u in ds.units for s in u.samples()]
    assert [(r.key, r.label, r.text) for r in rows[:3]] == [("a.png", "1", "one\nline two"), ("b.png", "2", "x"),
                                                            ("c.png", "3", "y")]
    assert (rows[3].key, rows[3].error) == ("m.csv:7", "line 7 has no path")
    assert rows[4].text == 'q "quoted"'
    prints = [u.fingerprint for u in ds.units]
    m.write_text(m.read_text().replace("c.png", "C.png"))  # the second unit's input changes
    again = [u.fingerprint for u in open_dataset(str(m), 100, tmp_path / "work").units]
    assert again[0] == prints[0] and again[1] != prints[1] and again[2] == prints[2]


def test_folder_index_streams_in_units(tmp_path, monkeypatch):
    import server.jobs.data as data

    monkeypatch.setattr(data, "FILES_PER_UNIT", 3)
    for i in range(7):
        (tmp_path / "f" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "f" / f"c{i % 2}" / f"{i}.png").write_bytes(b"x")
    ds = open_dataset(str(tmp_path / "f"), 100, tmp_path / "work")
    assert [u.count for u in ds.units] == [3, 3, 1] and (tmp_path / "work" / data.INDEX_FILE).is_file()
    keys = [s.key for u in ds.units for s in u.samples()]
    assert keys == sorted(keys) and len(keys) == 7
    assert all(s.path == str(tmp_path / "f" / s.key) for u in ds.units for s in u.samples())
