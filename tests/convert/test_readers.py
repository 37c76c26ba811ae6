"""Checkpoint readers: golden vmoe checkpoints read bit-exactly, broken ones fail with a clear message."""

from __future__ import annotations

import json
import os
import shutil
import stat
import zipfile
from pathlib import Path

import msgpack
import numpy as np
import pytest

from softmoe_models.convert.errors import ConversionError
from softmoe_models.convert.legacy import CHUNK_MARKER, read_partitioned
from softmoe_models.convert.npz import read_npz
from softmoe_models.convert.orbax import read_orbax
from softmoe_models.convert.readers import read_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
GOLDEN = SHARED / "golden" / "vmoe"
if not (GOLDEN / "softmoe_e4p2.npz").is_file():
    pytest.skip(f"golden files not found under {GOLDEN}", allow_module_level=True)

NPZ = GOLDEN / "softmoe_e4p2.npz"
PARTITIONED = GOLDEN / "checkpoint" / "partitioned" / "softmoe_e4p2"
ORBAX_CKPT = GOLDEN / "checkpoint" / "orbax" / "ckpt"
ORBAX_STEP = ORBAX_CKPT / "0"
SHARD0_NAME = "softmoe_e4p2.data-00000-of-00002"
SHARD1_NAME = "softmoe_e4p2.data-00001-of-00002"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    """The golden params, keys relative to ``params/``."""
    with np.load(NPZ) as z:
        return {k[len("params/"):]: z[k] for k in z.files if k.startswith("params/")}


def assert_bit_exact(params: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert set(params) == set(reference)
    for key, want in reference.items():
        got = params[key]
        assert got.dtype == np.float32 == want.dtype, key
        assert got.shape == want.shape, key
        assert np.array_equal(got, want), key


def writable_copy(src: Path, dst: Path) -> Path:
    """Copy a read-only golden tree and make the copy writable."""
    shutil.copytree(src, dst)
    for dirpath, _, filenames in os.walk(dst):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP)
    return dst


@pytest.fixture()
def partitioned_copy(tmp_path: Path) -> Path:
    """Writable copy of the partitioned checkpoint; returns its prefix."""
    return writable_copy(PARTITIONED.parent, tmp_path / "partitioned") / PARTITIONED.name


@pytest.fixture()
def orbax_copy(tmp_path: Path) -> Path:
    """Writable copy of the orbax ``ckpt`` directory."""
    return writable_copy(ORBAX_CKPT, tmp_path / "ckpt")


def unpack(path: Path):
    return msgpack.unpackb(path.read_bytes(), raw=False)


def pack(path: Path, content) -> None:
    path.write_bytes(msgpack.packb(content, use_bin_type=True))


def raised(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


# --------------------------------------------------------------------------- golden, bit-exact


def test_partitioned_golden_bit_exact(reference):
    assert_bit_exact(read_partitioned(PARTITIONED), reference)


def test_partitioned_accepts_index_path(reference):
    assert_bit_exact(read_partitioned(f"{PARTITIONED}.index"), reference)


@pytest.mark.parametrize("path", [ORBAX_STEP, ORBAX_STEP / "state", ORBAX_CKPT])
def test_orbax_golden_bit_exact(reference, path):
    params, notices = read_orbax(path)
    assert_bit_exact(params, reference)
    text = "\n".join(notices)
    assert "opt_state/" in text and "rngs/" in text and "step" in text


def test_orbax_ckpt_dir_names_step(reference):
    _, notices = read_orbax(ORBAX_CKPT)
    assert any("using step 0" in n for n in notices)


def test_npz_golden(reference):
    params, notices = read_npz(NPZ)
    assert_bit_exact(params, reference)
    assert any(n.startswith("ignored") and "outputs/" in n for n in notices)
    assert any("acts/" in n for n in notices)
    assert not any("params" in n for n in notices)


@pytest.mark.parametrize("name", ["softmoe_e8p1.npz", "twotower.npz"])
def test_npz_other_golden_files(name):
    params, _ = read_npz(GOLDEN / name)
    assert params and not any(k.startswith(("params/", "outputs", "acts", "inputs")) for k in params)
    assert all(v.dtype == np.float32 for v in params.values())


@pytest.mark.parametrize(
    "src, fmt",
    [
        (NPZ, "npz"),
        (PARTITIONED, "vmoe-partitioned"),
        (Path(f"{PARTITIONED}.index"), "vmoe-partitioned"),
        (ORBAX_CKPT, "orbax"),
        (ORBAX_STEP, "orbax"),
        (ORBAX_STEP / "state", "orbax"),
    ],
)
def test_read_checkpoint_detects_format(reference, src, fmt):
    params, notices, got_fmt = read_checkpoint(src)
    assert got_fmt == fmt
    assert_bit_exact(params, reference)
    if fmt == "vmoe-partitioned":
        assert notices == []
    if fmt == "orbax":
        assert any("opt_state" in n for n in notices) and any("rngs" in n for n in notices)


def test_read_checkpoint_accepts_str(reference):
    params, _, fmt = read_checkpoint(str(PARTITIONED))
    assert fmt == "vmoe-partitioned"
    assert_bit_exact(params, reference)


# --------------------------------------------------------------------------- partitioned variants


def test_partitioned_without_version_key(partitioned_copy, reference):
    index = Path(f"{partitioned_copy}.index")
    content = unpack(index)
    del content["version"]
    pack(index, content)
    assert_bit_exact(read_partitioned(partitioned_copy), reference)


def test_partitioned_unknown_version(partitioned_copy):
    index = Path(f"{partitioned_copy}.index")
    content = unpack(index)
    content["version"] = "29991231"
    pack(index, content)
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "unsupported format version" in raised(e)


def _ext(code: int, payload) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(payload, use_bin_type=True))


def _slice_nd_bytes(region) -> bytes:
    return msgpack.packb([msgpack.packb([a, b, None]) for a, b in region])


def write_tiny_checkpoint(prefix: Path, arrays: dict, dtype_name: str, chunk_rows: int) -> None:
    """A hand-made partitioned checkpoint: 2-D arrays cut into row chunks over 2 shards."""
    index_tree: dict = {}
    shards: list[dict] = [{CHUNK_MARKER: True}, {CHUNK_MARKER: True}]
    for number, path in enumerate(sorted(arrays)):
        array = arrays[path]
        regions, owners = [], []
        for i, start in enumerate(range(0, array.shape[0], chunk_rows)):
            region = [(start, min(start + chunk_rows, array.shape[0])), (0, array.shape[1])]
            owner = i % 2
            block = np.ascontiguousarray(array[region[0][0]:region[0][1]])
            sub = _ext(1, [list(block.shape), dtype_name, block.tobytes()])
            shards[owner].setdefault(str(number), []).append(
                [[sub], msgpack.ExtType(6, _slice_nd_bytes(region))]
            )
            regions.append(_slice_nd_bytes(region))
            owners.append(owner)
        shaped = msgpack.packb([list(array.shape), dtype_name, False, {}])
        node = index_tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _ext(8, [shaped, regions, owners])
    pack(Path(f"{prefix}.index"), {"shard_count": 2, "version": "20220622", "index": index_tree})
    for i, content in enumerate(shards):
        pack(prefix.with_name(f"{prefix.name}.data-{i:05d}-of-00002"), content)


def test_partitioned_bfloat16_returned_as_float32(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    arrays = {
        "a/kernel": rng.normal(size=(6, 3)).astype(ml_dtypes.bfloat16),
        "b": rng.normal(size=(5, 2)).astype(ml_dtypes.bfloat16),
    }
    write_tiny_checkpoint(tmp_path / "tiny", arrays, "bfloat16", chunk_rows=2)
    params = read_partitioned(tmp_path / "tiny")
    assert set(params) == set(arrays)
    for key, array in arrays.items():
        assert params[key].dtype == np.float32
        assert np.array_equal(params[key], array.astype(np.float32))


def test_partitioned_uses_sorted_leaf_numbering(tmp_path):
    # Keys chosen so that insertion order, plain sort and natural sort all differ.
    arrays = {k: np.full((2, 2), i, np.float32) for i, k in enumerate(["z", "b10", "b2", "B"])}
    write_tiny_checkpoint(tmp_path / "tiny", arrays, "float32", chunk_rows=1)
    params = read_partitioned(tmp_path / "tiny")
    for key, array in arrays.items():
        assert np.array_equal(params[key], array), key


# --------------------------------------------------------------------------- partitioned errors


def test_missing_path():
    with pytest.raises(ConversionError) as e:
        read_checkpoint(SHARED / "no" / "such" / "checkpoint")
    assert "does not exist" in raised(e) and "checkpoint" in raised(e)
    assert "accepted checkpoint forms" in raised(e)


def test_missing_index_file(tmp_path):
    with pytest.raises(ConversionError) as e:
        read_checkpoint(tmp_path / "nothing.index")
    assert "nothing.index" in raised(e) and "does not exist" in raised(e)
    with pytest.raises(ConversionError) as e:
        read_partitioned(tmp_path / "nothing")
    assert "does not exist" in raised(e)


def test_truncated_data_shard(partitioned_copy):
    shard = partitioned_copy.with_name(SHARD0_NAME)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError) as e:
        read_checkpoint(partitioned_copy)
    assert SHARD0_NAME in raised(e) and "truncated" in raised(e)


def test_missing_data_shard(partitioned_copy):
    partitioned_copy.with_name(SHARD1_NAME).unlink()
    with pytest.raises(ConversionError) as e:
        read_checkpoint(partitioned_copy)
    assert SHARD1_NAME in raised(e) and "missing" in raised(e)


def test_corrupted_index(partitioned_copy):
    index = Path(f"{partitioned_copy}.index")
    index.write_bytes(np.random.default_rng(1).bytes(3504))
    with pytest.raises(ConversionError) as e:
        read_checkpoint(partitioned_copy)
    assert "index file" in raised(e) and index.name in raised(e)


def test_index_that_is_not_a_map(partitioned_copy):
    pack(Path(f"{partitioned_copy}.index"), [1, 2, 3])
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "not a vmoe partitioned index" in raised(e)


def test_empty_index_file(partitioned_copy):
    Path(f"{partitioned_copy}.index").write_bytes(b"")
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "empty" in raised(e)


def _first_chunk(shard_content: dict) -> tuple[str, list]:
    key = next(k for k in shard_content if k != CHUNK_MARKER)
    return key, shard_content[key][0]


def test_chunk_size_mismatch(partitioned_copy):
    shard = partitioned_copy.with_name(SHARD0_NAME)
    content = unpack(shard)
    _, chunk = _first_chunk(content)
    shape, dtype, raw = msgpack.unpackb(chunk[0][0].data, raw=True)
    half = np.frombuffer(raw, np.float32)[: int(np.prod(shape)) // 2]
    chunk[0] = [_ext(1, [[half.size], dtype, half.tobytes()])]
    pack(shard, content)
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "elements but its slice extent" in raised(e) and SHARD0_NAME in raised(e)


def test_index_slice_changed(partitioned_copy):
    """An index slice no longer matching the data means the leaf numbering cannot be trusted."""
    index = Path(f"{partitioned_copy}.index")
    content = unpack(index)
    leaf = content["index"]["Encoder"]["encoder_norm"]["bias"]
    shaped, slices, shards = msgpack.unpackb(leaf.data, raw=True)
    slices = [_slice_nd_bytes([(0, 32)]), _slice_nd_bytes([(32, 64)])]
    content["index"]["Encoder"]["encoder_norm"]["bias"] = _ext(8, [shaped, slices, shards * 2])
    pack(index, content)
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "Encoder/encoder_norm/bias" in raised(e) and "not listed in the index" in raised(e)


def test_index_slice_out_of_bounds(partitioned_copy):
    index = Path(f"{partitioned_copy}.index")
    content = unpack(index)
    leaf = content["index"]["head"]["bias"]
    shaped, slices, shards = msgpack.unpackb(leaf.data, raw=True)
    content["index"]["head"]["bias"] = _ext(8, [shaped, [_slice_nd_bytes([(0, 999)])], shards])
    pack(index, content)
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "head/bias" in raised(e) and "out of bounds" in raised(e)


def test_chunk_dropped_from_data_shard(partitioned_copy):
    shard = partitioned_copy.with_name(SHARD1_NAME)
    content = unpack(shard)
    key = next(k for k in content if k != CHUNK_MARKER and len(content[k]) > 1)
    content[key] = content[key][1:]
    pack(shard, content)
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "is missing from data shard" in raised(e) and SHARD1_NAME in raised(e)


def test_data_shard_from_other_checkpoint(partitioned_copy):
    shard = partitioned_copy.with_name(SHARD0_NAME)
    content = unpack(shard)
    content["9999"] = content.pop(_first_chunk(content)[0])
    pack(shard, content)
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "not a leaf number" in raised(e)


def test_data_shard_without_marker(partitioned_copy):
    shard = partitioned_copy.with_name(SHARD0_NAME)
    content = unpack(shard)
    del content[CHUNK_MARKER]
    pack(shard, content)
    with pytest.raises(ConversionError) as e:
        read_partitioned(partitioned_copy)
    assert "not a vmoe array-chunk file" in raised(e)


def test_data_shard_passed_instead_of_prefix():
    with pytest.raises(ConversionError) as e:
        read_checkpoint(PARTITIONED.with_name(SHARD0_NAME))
    assert "pass its prefix" in raised(e)


# --------------------------------------------------------------------------- unrelated inputs


def test_png_file(tmp_path):
    png = tmp_path / "cat.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with pytest.raises(ConversionError) as e:
        read_checkpoint(png)
    assert "cat.png" in raised(e) and "PNG image" in raised(e)
    assert "accepted checkpoint forms" in raised(e)


def test_text_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(ConversionError) as e:
        read_checkpoint(text)
    assert "notes.txt" in raised(e) and "not a checkpoint" in raised(e)


def test_unrelated_directory(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "readme.md").write_text("nothing here")
    with pytest.raises(ConversionError) as e:
        read_checkpoint(tmp_path / "stuff")
    assert "stuff" in raised(e) and "_METADATA" in raised(e)
    assert "accepted checkpoint forms" in raised(e)


def test_directory_holding_partitioned_checkpoint_gives_hint():
    with pytest.raises(ConversionError) as e:
        read_checkpoint(PARTITIONED.parent)
    assert str(PARTITIONED) in raised(e)


def test_text_file_named_npz(tmp_path):
    bogus = tmp_path / "params.npz"
    bogus.write_text("not a zip")
    with pytest.raises(ConversionError) as e:
        read_checkpoint(bogus)
    assert "params.npz" in raised(e) and "not an .npz archive" in raised(e)


# --------------------------------------------------------------------------- npz errors


def test_npz_with_no_arrays(tmp_path):
    empty = tmp_path / "empty.npz"
    np.savez(empty)
    with pytest.raises(ConversionError) as e:
        read_checkpoint(empty)
    assert "empty.npz" in raised(e) and "no arrays" in raised(e)


def test_zip_that_is_not_npz(tmp_path):
    archive = tmp_path / "archive.npz"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(ConversionError) as e:
        read_npz(archive)
    assert "archive.npz" in raised(e) and "not a numpy array" in raised(e)


def test_truncated_npz(tmp_path):
    cut = tmp_path / "cut.npz"
    data = NPZ.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError) as e:
        read_npz(cut)
    assert "cut.npz" in raised(e)


def test_npz_with_pickled_object(tmp_path):
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **{"params/x": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ConversionError) as e:
        read_npz(pickled)
    assert "pickled" in raised(e)


def test_npz_without_params_prefix(tmp_path):
    plain = tmp_path / "plain.npz"
    np.savez(plain, **{"head/bias": np.ones(3, np.float32), "head/kernel": np.ones((2, 3))})
    params, notices = read_npz(plain)
    assert set(params) == {"head/bias", "head/kernel"} and notices == []


def test_npz_notice_per_group(tmp_path):
    mixed = tmp_path / "mixed.npz"
    arrays = {"params/head/bias": np.ones(3), "outputs/a": np.ones(1), "outputs/b": np.ones(1),
              "inputs/images": np.ones(1)}
    np.savez(mixed, **arrays)
    params, notices = read_npz(mixed)
    assert set(params) == {"head/bias"}
    assert sorted(notices) == ["ignored 1 array under inputs/", "ignored 2 arrays under outputs/"]


# --------------------------------------------------------------------------- orbax errors


def test_orbax_corrupt_manifest(orbax_copy):
    manifest = orbax_copy / "0" / "state" / "manifest.ocdbt"
    manifest.write_bytes(np.random.default_rng(2).bytes(manifest.stat().st_size))
    with pytest.raises(ConversionError) as e:
        read_checkpoint(orbax_copy / "0")
    assert "cannot open array 'params/" in raised(e) and "corrupt" in raised(e)


def test_orbax_missing_manifest(orbax_copy):
    (orbax_copy / "0" / "state" / "manifest.ocdbt").unlink()
    with pytest.raises(ConversionError) as e:
        read_checkpoint(orbax_copy / "0")
    assert "params/" in raised(e)


def test_orbax_missing_data_files(orbax_copy):
    data_dir = orbax_copy / "0" / "state" / "ocdbt.process_0" / "d"
    for f in data_dir.iterdir():
        f.unlink()
    with pytest.raises(ConversionError) as e:
        read_checkpoint(orbax_copy / "0" / "state")
    assert "cannot read array 'params/" in raised(e)


def test_orbax_truncated_data_file(orbax_copy):
    data_dir = orbax_copy / "0" / "state" / "ocdbt.process_0" / "d"
    for f in data_dir.iterdir():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ConversionError) as e:
        read_checkpoint(orbax_copy)
    assert "params/" in raised(e) and "incomplete or corrupt" in raised(e)


def test_orbax_corrupt_metadata(orbax_copy):
    (orbax_copy / "0" / "state" / "_METADATA").write_text('{"tree_metadata": {')
    with pytest.raises(ConversionError) as e:
        read_checkpoint(orbax_copy / "0")
    assert "_METADATA is not valid JSON" in raised(e)


def test_orbax_metadata_without_params(orbax_copy):
    path = orbax_copy / "0" / "state" / "_METADATA"
    meta = json.loads(path.read_text())
    meta["tree_metadata"] = {k: v for k, v in meta["tree_metadata"].items() if "params" not in k}
    path.write_text(json.dumps(meta))
    with pytest.raises(ConversionError) as e:
        read_orbax(orbax_copy / "0")
    assert "no 'params' arrays" in raised(e) and "opt_state" in raised(e)


def test_orbax_highest_complete_step(orbax_copy, reference):
    shutil.copytree(orbax_copy / "0", orbax_copy / "7")
    (orbax_copy / "9").mkdir()  # started but never finished
    (orbax_copy / "12.orbax-checkpoint-tmp-3").mkdir()
    params, notices = read_orbax(orbax_copy)
    assert_bit_exact(params, reference)
    assert any("using step 7" in n and "skipped incomplete steps: 9" in n for n in notices)


def test_orbax_ckpt_dir_without_complete_step(tmp_path):
    (tmp_path / "ckpt" / "3").mkdir(parents=True)
    with pytest.raises(ConversionError) as e:
        read_checkpoint(tmp_path / "ckpt")
    assert "ckpt" in raised(e)
    with pytest.raises(ConversionError) as e:
        read_orbax(tmp_path / "ckpt")
    assert "no complete numbered step" in raised(e)


def _write_plain_zarr_state(state_dir: Path, arrays: dict[str, np.ndarray]) -> None:
    """An orbax-like state dir without OCDBT: one zarr v2 directory per array."""
    ts = pytest.importorskip("tensorstore")
    tree = {}
    for path, array in arrays.items():
        keys = path.split("/")
        tree[str(tuple(keys))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in keys],
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False},
        }
        store = ts.open(
            {
                "driver": "zarr",
                "kvstore": {"driver": "file", "path": f"{state_dir}/{'.'.join(keys)}/"},
                "metadata": {"chunks": [1] + list(array.shape[1:])},
            },
            create=True,
            dtype=array.dtype,
            shape=array.shape,
        ).result()
        store.write(array).result()
    meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True}
    (state_dir / "_METADATA").write_text(json.dumps(meta))


def test_orbax_without_ocdbt(tmp_path):
    state = tmp_path / "ckpt" / "3" / "state"
    state.mkdir(parents=True)
    arrays = {"params/head/kernel": np.arange(12, dtype=np.float32).reshape(4, 3),
              "opt_state/mu/head/kernel": np.zeros((4, 3), np.float32)}
    _write_plain_zarr_state(state, arrays)
    params, notices, fmt = read_checkpoint(tmp_path / "ckpt")
    assert fmt == "orbax"
    assert np.array_equal(params["head/kernel"], arrays["params/head/kernel"])
    assert "ignored 1 array under opt_state/ (optimizer state)" in notices
    # Orbax stored every chunk, so a deleted chunk is an error, not silent zeros.
    (state / "params.head.kernel" / "2.0").unlink()
    with pytest.raises(ConversionError) as e:
        read_checkpoint(tmp_path / "ckpt")
    assert "cannot read array 'params/head/kernel'" in raised(e)
