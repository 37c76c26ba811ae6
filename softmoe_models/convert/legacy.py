"""Reader for vmoe's legacy "partitioned" checkpoints, with numpy + msgpack only.

A checkpoint with prefix ``X`` is one index file and ``S`` data shards::

    X.index                  msgpack map {'shard_count': S, 'version': '20220622', 'index': tree}
    X.data-00000-of-0000S    msgpack map {'__msgpack_array_chunk_a87ca2__': True,
    ...                                   '<leaf number>': [[subchunks, global_slice], ...]}

``tree`` is the saved pytree (nested maps with string keys). Each leaf is an ``IndexInfo``
(msgpack ExtType 8) holding the global shape and dtype, the list of global slices ("chunks") the
array was cut into and, for each chunk, the number of the data shard holding it. Leaves are
numbered in JAX flatten order, i.e. depth first with the keys of every map sorted. In a data shard
each chunk is stored flattened, split into subchunks (ExtType 1 arrays) that are concatenated and
reshaped to the extent of the chunk's slice before being written into the full array.

Custom msgpack ExtType codes (their payloads are msgpack too; values nested inside a payload are
stored as packed msgpack bytes without an ExtType wrapper):

====  ==============  ===========================================================
code  type            payload
====  ==============  ===========================================================
1     ndarray         ``(shape, dtype_name, raw C-order bytes)``
3     numpy scalar    same as 1, taken with ``[()]``
4     ShapedArray     ``(shape, dtype_name, weak_type, {})``
5     Slice           ``(start, stop, step)``
6     SliceNd         tuple of Slice payloads (empty for scalars)
7     SliceNdArray    ``(shape, tuple of SliceNd payloads)``
8     IndexInfo       ``(ShapedArray payload, tuple of SliceNd payloads, tuple of shard ints)``
====  ==============  ===========================================================

Checkpoints written before 2022-06-22 have no ``version`` key; their files are encoded the same
way and, for a params-only tree, their leaves follow the same sorted-key order. Because that order
cannot be proven from the files alone, every chunk is checked against the index entry of the leaf
it is assigned to (its slice must be one the index lists, its size must match the slice extent)
and every element of every leaf must be covered by some chunk.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Iterator, Union

import msgpack
import ml_dtypes
import numpy as np

from .errors import ConversionError

PathLike = Union[str, "os.PathLike[str]"]

EXT_NDARRAY = 1
EXT_NP_SCALAR = 3
EXT_SHAPED_ARRAY = 4
EXT_SLICE = 5
EXT_SLICE_ND = 6
EXT_SLICE_ND_ARRAY = 7
EXT_INDEX_INFO = 8

CHUNK_MARKER = "__msgpack_array_chunk_a87ca2__"
KNOWN_VERSIONS = ("20220622",)

# A chunk's position in its leaf: one (start, stop) pair per axis.
Region = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class LeafIndex:
    """What the index says about one saved array.

    Attributes:
        path: '/'-joined key path of the leaf in the saved tree.
        shape: global shape of the array.
        dtype: numpy dtype of the array (``ml_dtypes.bfloat16`` for bfloat16).
        chunks: the regions the array was cut into, in index order.
        shards: for each chunk, the number of the data shard holding it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[Region, ...]
    shards: tuple[int, ...]


def split_prefix(path: PathLike) -> Path:
    """Return the checkpoint prefix for a prefix or the path of its ``.index`` file.

    Args:
        path: ``X`` or ``X.index``.
    """
    text = os.fspath(path)
    if text.endswith(".index"):
        text = text[: -len(".index")]
    return Path(text)


def index_path(prefix: Path) -> Path:
    """Path of the index file for ``prefix``.

    Args:
        prefix: the checkpoint prefix ``X``.
    """
    return prefix.with_name(prefix.name + ".index")


def shard_path(prefix: Path, shard: int, shard_count: int) -> Path:
    """Path of data shard ``shard`` (zero-based) out of ``shard_count``.

    Args:
        prefix: the checkpoint prefix ``X``.
        shard: shard number.
        shard_count: total number of shards.
    """
    return prefix.with_name(f"{prefix.name}.data-{shard:05d}-of-{shard_count:05d}")


# --------------------------------------------------------------------------- msgpack decoding


def _payload(obj: Any, code: int, what: str) -> Any:
    """Unpack the msgpack payload of a custom type.

    Top-level values arrive as ``ExtType``; values nested in another payload arrive as the packed
    bytes of their payload. Both are accepted.

    Args:
        obj: an ``ExtType`` or packed bytes.
        code: the expected ExtType code.
        what: name of the expected type, for error messages.
    """
    if isinstance(obj, msgpack.ExtType):
        if obj.code != code:
            raise ValueError(f"expected {what} (msgpack ExtType {code}), got ExtType {obj.code}")
        data = obj.data
    elif isinstance(obj, (bytes, bytearray)):
        data = obj
    else:
        raise ValueError(f"expected {what} (msgpack ExtType {code}), got {type(obj).__name__}")
    return msgpack.unpackb(data, raw=True)


def _text(value: Any) -> str:
    """Decode a msgpack string that may have been unpacked as bytes.

    Args:
        value: ``bytes`` or ``str``.
    """
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def _shape(value: Any) -> tuple[int, ...]:
    """Validate and convert a msgpack shape.

    Args:
        value: a list of non-negative ints.
    """
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise ValueError(f"invalid shape {value!r}")
    return tuple(value)


def numpy_dtype(name: str) -> np.dtype:
    """Map a dtype name from a checkpoint to a numpy dtype.

    Args:
        name: numpy dtype name; ``bfloat16`` and the float8 types come from ``ml_dtypes``.
    """
    try:
        return np.dtype(name)
    except TypeError:
        pass
    if not hasattr(ml_dtypes, name):
        raise ValueError(f"unknown dtype {name!r}")
    return np.dtype(getattr(ml_dtypes, name))


def decode_ndarray(obj: Any) -> np.ndarray:
    """Decode an ndarray (code 1) or numpy scalar (code 3).

    Args:
        obj: ``ExtType`` with code 1 or 3, or packed bytes of a code-1 payload.
    """
    code = obj.code if isinstance(obj, msgpack.ExtType) else EXT_NDARRAY
    if code not in (EXT_NDARRAY, EXT_NP_SCALAR):
        raise ValueError(f"expected an ndarray (msgpack ExtType 1 or 3), got ExtType {code}")
    payload = _payload(obj, code, "ndarray")
    if not isinstance(payload, (list, tuple)) or len(payload) != 3:
        raise ValueError("malformed ndarray payload")
    shape = _shape(payload[0])
    dtype = numpy_dtype(_text(payload[1]))
    data = payload[2]
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError("malformed ndarray payload: data is not bytes")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"ndarray of shape {shape} {dtype.name} needs {expected} bytes, has {len(data)}"
        )
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array[()] if code == EXT_NP_SCALAR else array


def decode_slice_nd(obj: Any) -> tuple[tuple[Any, Any, Any], ...]:
    """Decode a SliceNd (code 6) into raw ``(start, stop, step)`` triples.

    Args:
        obj: ``ExtType`` 6 or packed bytes of its payload.
    """
    payload = _payload(obj, EXT_SLICE_ND, "SliceNd")
    if not isinstance(payload, (list, tuple)):
        raise ValueError("malformed SliceNd payload")
    triples = []
    for item in payload:
        triple = _payload(item, EXT_SLICE, "Slice")
        if not isinstance(triple, (list, tuple)) or len(triple) != 3:
            raise ValueError(f"malformed Slice payload {triple!r}")
        triples.append(tuple(triple))
    return tuple(triples)


def decode_slice_nd_array(obj: Any) -> tuple[tuple[int, ...], list[tuple[tuple[Any, Any, Any], ...]]]:
    """Decode a SliceNdArray (code 7): a shape and a list of SliceNd.

    Args:
        obj: ``ExtType`` 7 or packed bytes of its payload.
    """
    payload = _payload(obj, EXT_SLICE_ND_ARRAY, "SliceNdArray")
    if not isinstance(payload, (list, tuple)) or len(payload) != 2:
        raise ValueError("malformed SliceNdArray payload")
    return _shape(payload[0]), [decode_slice_nd(s) for s in payload[1]]


def to_region(triples: tuple[tuple[Any, Any, Any], ...], shape: tuple[int, ...]) -> Region:
    """Resolve raw slice triples against an array shape, checking they are in bounds.

    Args:
        triples: ``(start, stop, step)`` per axis, ``None`` meaning the default.
        shape: the global shape of the leaf.
    """
    if len(triples) != len(shape):
        raise ValueError(f"slice has {len(triples)} axes but the array has shape {shape}")
    region = []
    for (start, stop, step), dim in zip(triples, shape):
        start = 0 if start is None else start
        stop = dim if stop is None else stop
        if step not in (None, 1):
            raise ValueError(f"slice step {step} is not supported")
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= dim):
            raise ValueError(f"slice {start}:{stop} is out of bounds for shape {shape}")
        region.append((start, stop))
    return tuple(region)


def format_region(region: Region) -> str:
    """Render a region like numpy indexing, e.g. ``[0:4, 16:32]``.

    Args:
        region: ``(start, stop)`` per axis.
    """
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def decode_index_info(obj: Any, path: str) -> LeafIndex:
    """Decode an IndexInfo (code 8) leaf of the index tree.

    Args:
        obj: ``ExtType`` 8.
        path: the leaf's key path, recorded in the result.
    """
    payload = _payload(obj, EXT_INDEX_INFO, "IndexInfo")
    if not isinstance(payload, (list, tuple)) or len(payload) != 3:
        raise ValueError("malformed IndexInfo payload")
    shaped, slices, shards = payload
    aval = _payload(shaped, EXT_SHAPED_ARRAY, "ShapedArray")
    if not isinstance(aval, (list, tuple)) or len(aval) < 2:
        raise ValueError("malformed ShapedArray payload")
    shape = _shape(aval[0])
    dtype = numpy_dtype(_text(aval[1]))
    chunks = tuple(to_region(decode_slice_nd(s), shape) for s in slices)
    if not isinstance(shards, (list, tuple)) or len(shards) != len(chunks):
        raise ValueError(f"{len(chunks)} chunks but shard list {shards!r}")
    if not all(isinstance(s, int) and s >= 0 for s in shards):
        raise ValueError(f"invalid shard numbers {shards!r}")
    return LeafIndex(path, shape, dtype, chunks, tuple(shards))


# --------------------------------------------------------------------------- index


def flatten_tree(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` depth first with sorted keys (JAX flatten order).

    ``None`` is an empty subtree, as in JAX. Lists are walked in order with their position as key.

    Args:
        tree: nested maps/lists from the index.
        prefix: path of ``tree`` itself.
    """
    if tree is None:
        return
    if isinstance(tree, msgpack.ExtType):  # a namedtuple: test it before lists/tuples
        yield prefix, tree
        return
    if isinstance(tree, dict):
        items = sorted((_text(k), v) for k, v in tree.items())
    elif isinstance(tree, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        yield prefix, tree
        return
    for key, value in items:
        yield from flatten_tree(value, f"{prefix}/{key}" if prefix else key)


def _unpack_file(path: Path, role: str) -> Any:
    """Read and unpack a whole msgpack file.

    Args:
        path: the file.
        role: what the file is ("index file", "data shard"), for error messages.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConversionError(f"cannot read {role} {path}: {e.strerror or e}") from e
    if not raw:
        raise ConversionError(f"{role} {path} is empty")
    try:
        return msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises ValueError subclasses, ExtraData, StackError ...
        raise ConversionError(
            f"{role} {path} is truncated or not a vmoe msgpack file ({type(e).__name__}: {e})"
        ) from e


def read_index(prefix: Path) -> tuple[int, str | None, list[LeafIndex]]:
    """Read ``X.index``: shard count, format version and the leaves in numbering order.

    Args:
        prefix: the checkpoint prefix ``X``.
    """
    path = index_path(prefix)
    if not path.is_file():
        raise ConversionError(f"vmoe partitioned checkpoint index {path} does not exist")
    content = _unpack_file(path, "index file")
    if not isinstance(content, dict) or "index" not in content or "shard_count" not in content:
        raise ConversionError(
            f"index file {path} is not a vmoe partitioned index "
            "(expected a map with 'shard_count' and 'index')"
        )
    shard_count = content["shard_count"]
    if not isinstance(shard_count, int) or shard_count < 1:
        raise ConversionError(f"index file {path} has invalid shard_count {shard_count!r}")
    version = content.get("version")
    if version is not None and _text(version) not in KNOWN_VERSIONS:
        raise ConversionError(
            f"index file {path} has unsupported format version {version!r} "
            f"(known: {', '.join(KNOWN_VERSIONS)} and unversioned)"
        )
    leaves = []
    for leaf_path, leaf in flatten_tree(content["index"]):
        try:
            info = decode_index_info(leaf, leaf_path)
        except Exception as e:
            raise ConversionError(f"index file {path}: bad entry for '{leaf_path}': {e}") from e
        bad = [s for s in info.shards if s >= shard_count]
        if bad:
            raise ConversionError(
                f"index file {path}: '{leaf_path}' refers to data shard {bad[0]} "
                f"but the checkpoint has {shard_count} shards"
            )
        leaves.append(info)
    if not leaves:
        raise ConversionError(f"index file {path} describes no arrays")
    return shard_count, None if version is None else _text(version), leaves


# --------------------------------------------------------------------------- data shards


class _Assembler:
    """Collects chunks into full arrays, checking each chunk and the final coverage."""

    def __init__(self, leaves: list[LeafIndex]):
        self.leaves = leaves
        self.arrays = [np.zeros(leaf.shape, dtype=leaf.dtype) for leaf in leaves]
        self.covered = [np.zeros(leaf.shape, dtype=bool) for leaf in leaves]
        self.found: list[set[Region]] = [set() for _ in leaves]
        self.owners: list[dict[Region, set[int]]] = []
        for leaf in leaves:
            owners: dict[Region, set[int]] = {}
            for region, shard in zip(leaf.chunks, leaf.shards):
                owners.setdefault(region, set()).add(shard)
            self.owners.append(owners)

    def add(self, number: int, region: Region, data: np.ndarray, shard: int) -> None:
        """Write one chunk of leaf ``number``.

        Args:
            number: leaf number.
            region: where the chunk goes.
            data: the concatenated, still flat chunk.
            shard: the data shard it came from.
        """
        leaf = self.leaves[number]
        where = f"'{leaf.path}' chunk {format_region(region)}"
        expected = self.owners[number].get(region)
        if not expected:
            raise ValueError(
                f"{where} is not listed in the index for this leaf {leaf.shape} "
                "(leaf numbering does not match the index)"
            )
        if shard not in expected:
            raise ValueError(f"{where} found in shard {shard}, index says shard {min(expected)}")
        extent = tuple(b - a for a, b in region)
        if data.size != math.prod(extent):
            raise ValueError(
                f"{where} has {data.size} elements but its slice extent {extent} needs "
                f"{math.prod(extent)}"
            )
        if data.dtype != leaf.dtype:
            raise ValueError(f"{where} has dtype {data.dtype.name}, index says {leaf.dtype.name}")
        index = tuple(slice(a, b) for a, b in region) + (Ellipsis,)  # 0-d views for scalars
        block = data.reshape(extent)
        seen = self.covered[number][index]
        if seen.any() and not np.array_equal(
            self.arrays[number][index][seen].view(np.uint8), block[seen].view(np.uint8)
        ):
            raise ValueError(f"{where} overlaps an earlier chunk with different values")
        self.arrays[number][index] = block
        self.covered[number][index] = True
        self.found[number].add(region)

    def finish(self, prefix: Path, shard_count: int) -> dict[str, np.ndarray]:
        """Check every listed chunk arrived and every element is covered; return the arrays.

        Args:
            prefix: checkpoint prefix, for error messages.
            shard_count: number of data shards, for error messages.
        """
        for leaf, array, covered, found in zip(self.leaves, self.arrays, self.covered, self.found):
            for region, shard in zip(leaf.chunks, leaf.shards):
                if region not in found:
                    raise ConversionError(
                        f"'{leaf.path}' chunk {format_region(region)} is missing from data shard "
                        f"{shard_path(prefix, shard, shard_count)}"
                    )
            if not covered.all():
                missing = int(covered.size - covered.sum())
                raise ConversionError(
                    f"'{leaf.path}' {leaf.shape}: {missing} of {covered.size} elements are not "
                    f"covered by any chunk in {prefix}.data-*"
                )
        return {leaf.path: array for leaf, array in zip(self.leaves, self.arrays)}


def _concat_subchunks(subchunks: Any) -> np.ndarray:
    """Decode and concatenate the flat subchunks of one chunk.

    Args:
        subchunks: list of code-1 ExtTypes.
    """
    if not isinstance(subchunks, (list, tuple)) or not subchunks:
        raise ValueError("chunk has no subchunks")
    parts = [decode_ndarray(s).reshape(-1) for s in subchunks]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _read_shard(path: Path, shard: int, assembler: _Assembler) -> None:
    """Read one data shard and hand its chunks to ``assembler``.

    Args:
        path: the data shard file.
        shard: its number.
        assembler: collects the chunks.
    """
    content = _unpack_file(path, "data shard")
    if not isinstance(content, dict) or content.get(CHUNK_MARKER) is not True:
        raise ConversionError(
            f"data shard {path} is not a vmoe array-chunk file (missing '{CHUNK_MARKER}')"
        )
    num_leaves = len(assembler.leaves)
    for key, chunks in content.items():
        if key == CHUNK_MARKER:
            continue
        if not (isinstance(key, str) and key.isdigit() and int(key) < num_leaves):
            raise ConversionError(
                f"data shard {path} has key {key!r}, not a leaf number below {num_leaves} "
                "(index and data files do not belong together)"
            )
        number = int(key)
        leaf = assembler.leaves[number]
        try:
            if not isinstance(chunks, (list, tuple)):
                raise ValueError("chunk list is not a list")
            for chunk in chunks:
                if not isinstance(chunk, (list, tuple)) or len(chunk) != 2:
                    raise ValueError("malformed chunk entry")
                region = to_region(decode_slice_nd(chunk[1]), leaf.shape)
                assembler.add(number, region, _concat_subchunks(chunk[0]), shard)
        except ConversionError:
            raise
        except Exception as e:
            raise ConversionError(f"data shard {path}, leaf {number} ('{leaf.path}'): {e}") from e


def read_partitioned(prefix: PathLike) -> dict[str, np.ndarray]:
    """Read a vmoe legacy partitioned checkpoint into flat numpy arrays.

    Args:
        prefix: the checkpoint prefix ``X`` (files ``X.index``, ``X.data-*``) or ``X.index``.

    Returns:
        ``{'/'-joined leaf path: array}`` for every leaf of the saved tree. bfloat16 arrays are
        returned as float32; other dtypes are kept.

    Raises:
        ConversionError: a file is missing, truncated or inconsistent with the index.
    """
    prefix = split_prefix(prefix)
    try:
        shard_count, _version, leaves = read_index(prefix)
        assembler = _Assembler(leaves)
        needed = sorted({s for leaf in leaves for s in leaf.shards})
        for shard in needed:
            path = shard_path(prefix, shard, shard_count)
            if not path.is_file():
                raise ConversionError(
                    f"data shard {path} is missing (index {index_path(prefix)} lists "
                    f"{shard_count} shards)"
                )
            _read_shard(path, shard, assembler)
        arrays = assembler.finish(prefix, shard_count)
    except ConversionError:
        raise
    except Exception as e:  # anything unforeseen still gets the file named
        raise ConversionError(
            f"cannot read vmoe partitioned checkpoint {prefix}: {type(e).__name__}: {e}"
        ) from e
    return {path: _to_output_dtype(a) for path, a in arrays.items()}


def _to_output_dtype(array: np.ndarray) -> np.ndarray:
    """Widen bfloat16 to float32; keep everything else.

    Args:
        array: an assembled leaf.
    """
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array
