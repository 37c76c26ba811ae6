"""Reader for orbax checkpoints written by current vmoe trainers, with tensorstore only (no JAX).

Layout of ``<workdir>/ckpt/<step>/state/`` (the ``TrainState`` item)::

    _METADATA         JSON: 'tree_metadata' maps "('params', 'Encoder', ...)" to key_metadata
                      (the key path) and value_metadata (value_type 'jax.Array', 'None', ...),
                      plus 'use_ocdbt', 'use_zarr3', 'store_array_data_equal_to_fill_value'
    manifest.ocdbt    OCDBT key-value store (use_ocdbt), with ocdbt.process_*/ and d/ ...
    <dotted.path>/    ... holding one zarr array per leaf under the key prefix 'params.Encoder...'
                      (without OCDBT: one directory per array with that name)

Only the ``params`` subtree is returned. ``opt_state`` (Adam moments mirroring params), ``rngs`` and
``step`` are skipped and reported. When orbax stored every chunk
(``store_array_data_equal_to_fill_value``), a missing chunk is an error instead of silently reading
as zeros.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import Any, Union

import numpy as np

from .errors import ConversionError
from .npz import PARAMS_GROUP, ignored_notice

PathLike = Union[str, "os.PathLike[str]"]

METADATA_FILE = "_METADATA"
STATE_ITEM = "state"


def _has_metadata(directory: Path) -> bool:
    """Whether ``directory`` is an orbax PyTree item directory.

    Args:
        directory: candidate ``state`` directory.
    """
    return (directory / METADATA_FILE).is_file()


def step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Numbered step directories of a ``ckpt`` directory, lowest first.

    Unfinished saves (``<step>.orbax-checkpoint-tmp-*``) are not numbered and never listed.

    Args:
        ckpt_dir: the ``ckpt`` directory.
    """
    steps = []
    for child in ckpt_dir.iterdir():
        if child.is_dir() and child.name.isdigit():
            steps.append((int(child.name), child))
    return sorted(steps)


def is_complete_step(step_dir: Path) -> bool:
    """Whether a step directory holds a readable ``state`` item.

    Args:
        step_dir: ``ckpt/<step>``.
    """
    return _has_metadata(step_dir / STATE_ITEM)


def locate_state_dir(path: PathLike) -> tuple[Path, list[str]]:
    """Find the ``state`` item directory from any of the accepted paths.

    Args:
        path: ``ckpt/<step>/state``, ``ckpt/<step>`` or ``ckpt`` (highest complete step wins).

    Returns:
        The state directory and notices (which step was picked).
    """
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"orbax checkpoint directory {path} does not exist")
    if _has_metadata(path):
        return path, []
    if _has_metadata(path / STATE_ITEM):
        return path / STATE_ITEM, []
    steps = step_dirs(path)
    complete = [(step, d) for step, d in steps if is_complete_step(d)]
    if not complete:
        found = ", ".join(str(s) for s, _ in steps) or "none"
        raise ConversionError(
            f"{path} is not an orbax checkpoint: no {METADATA_FILE}, no {STATE_ITEM}/{METADATA_FILE} "
            f"and no complete numbered step directory (numbered directories: {found})"
        )
    step, step_dir = complete[-1]
    notice = f"using step {step}, the highest complete step in {path}"
    skipped = [s for s, d in steps if s > step]
    if skipped:
        notice += f" (skipped incomplete steps: {', '.join(map(str, skipped))})"
    return step_dir / STATE_ITEM, [notice]


def load_metadata(state_dir: Path) -> dict[str, Any]:
    """Read and validate ``_METADATA``.

    Args:
        state_dir: the ``state`` item directory.
    """
    path = state_dir / METADATA_FILE
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(metadata, dict) or not isinstance(metadata.get("tree_metadata"), dict):
        raise ConversionError(
            f"{path} has no 'tree_metadata' map; very old orbax layouts (msgpack aggregate "
            "file) are not supported"
        )
    return metadata


def _key_path(name: str, entry: Any) -> tuple[str, ...]:
    """The key path of one ``tree_metadata`` entry.

    Args:
        name: the stringified key tuple, e.g. ``"('params', 'head', 'bias')"``.
        entry: its value, with ``key_metadata`` in recent orbax versions.
    """
    keys = entry.get("key_metadata") if isinstance(entry, dict) else None
    if isinstance(keys, list) and keys:
        return tuple(str(k["key"]) for k in keys)
    parsed = ast.literal_eval(name)
    if not isinstance(parsed, tuple) or not parsed:
        raise ValueError(f"cannot parse key {name!r}")
    return tuple(str(k) for k in parsed)


def list_arrays(metadata: dict[str, Any], source: Path) -> list[tuple[tuple[str, ...], str]]:
    """Every stored array as ``(key path, value_type)``; ``None`` leaves are dropped.

    Args:
        metadata: parsed ``_METADATA``.
        source: the ``_METADATA`` file, for error messages.
    """
    arrays = []
    for name, entry in metadata["tree_metadata"].items():
        try:
            keys = _key_path(name, entry)
            value = entry.get("value_metadata", {})
            value_type = str(value.get("value_type", "jax.Array"))
            skip = bool(value.get("skip_deserialize", False))
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{source}: malformed tree_metadata entry {name!r} ({e})") from e
        if value_type == "None" or skip:
            continue
        arrays.append((keys, value_type))
    return arrays


def skipped_notices(arrays: list[tuple[tuple[str, ...], str]]) -> list[str]:
    """One notice per top-level group other than ``params``.

    Args:
        arrays: output of :func:`list_arrays`.
    """
    counts: dict[str, int] = {}
    leaves: set[str] = set()
    for keys, _ in arrays:
        if keys[0] == PARAMS_GROUP:
            continue
        counts[keys[0]] = counts.get(keys[0], 0) + 1
        if len(keys) == 1:
            leaves.add(keys[0])
    return [ignored_notice(g, n, is_leaf=g in leaves and n == 1) for g, n in counts.items()]


def array_spec(state_dir: Path, metadata: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """Tensorstore spec of one stored array.

    Args:
        state_dir: absolute ``state`` directory.
        metadata: parsed ``_METADATA``.
        keys: the array's key path; orbax names it by the dotted path.
    """
    dotted = ".".join(keys)
    if metadata.get("use_ocdbt", False):
        kvstore = {
            "driver": "ocdbt",
            "base": {"driver": "file", "path": f"{state_dir}/"},
            "path": f"{dotted}/",
        }
    else:
        kvstore = {"driver": "file", "path": f"{state_dir}/{dotted}/"}
    spec: dict[str, Any] = {
        "driver": "zarr3" if metadata.get("use_zarr3", False) else "zarr",
        "kvstore": kvstore,
    }
    if metadata.get("store_array_data_equal_to_fill_value", False):
        spec["fill_missing_data_reads"] = False  # every chunk was written: absent = lost
    return spec


def _to_numpy(value: Any) -> np.ndarray:
    """Plain numpy array; bfloat16 widened to float32.

    Args:
        value: what tensorstore returned.
    """
    array = np.asarray(value)
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def read_arrays(
    state_dir: Path, metadata: dict[str, Any], keys_list: list[tuple[str, ...]]
) -> dict[str, np.ndarray]:
    """Read arrays with tensorstore, all requests in flight at once.

    Args:
        state_dir: absolute ``state`` directory.
        metadata: parsed ``_METADATA``.
        keys_list: key paths to read.

    Returns:
        '/'-joined key path -> array.
    """
    try:  # heavy: tensorstore only for an orbax checkpoint
        import tensorstore as ts
    except ImportError as e:
        raise ConversionError(
            "reading orbax checkpoints needs tensorstore: pip install tensorstore"
        ) from e
    context = ts.Context()

    def fail(keys: tuple[str, ...], stage: str, error: Exception) -> ConversionError:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        message = re.sub(r"\s*\[tensorstore_spec=.*$", "", message)  # drop the echoed spec
        return ConversionError(
            f"orbax checkpoint {state_dir}: cannot {stage} array '{'/'.join(keys)}' "
            f"(stored as '{'.'.join(keys)}'): {message}; the checkpoint is incomplete or corrupt"
        )

    opened = []
    for keys in keys_list:
        try:
            opened.append(ts.open(array_spec(state_dir, metadata, keys), open=True, read=True,
                                  context=context))
        except Exception as e:
            raise fail(keys, "open", e) from e
    stores = []
    for keys, future in zip(keys_list, opened):
        try:
            stores.append(future.result())
        except Exception as e:
            raise fail(keys, "open", e) from e
    reads = [store.read() for store in stores]
    result = {}
    for keys, future in zip(keys_list, reads):
        try:
            result["/".join(keys)] = _to_numpy(future.result())
        except Exception as e:
            raise fail(keys, "read", e) from e
    return result


def read_orbax(path: PathLike) -> tuple[dict[str, np.ndarray], list[str]]:
    """Read the params of a vmoe orbax checkpoint.

    Args:
        path: ``ckpt/<step>/state``, ``ckpt/<step>`` or ``ckpt`` (the highest complete step is
            used and named in a notice).

    Returns:
        Params keyed by '/'-joined path relative to ``params``, and notices: the step picked and
        one line per skipped group, e.g. "ignored 90 arrays under opt_state/ (optimizer state)".

    Raises:
        ConversionError: not an orbax checkpoint, no params, or an array cannot be read.
    """
    state_dir, notices = locate_state_dir(path)
    state_dir = state_dir.resolve()
    metadata = load_metadata(state_dir)
    arrays = list_arrays(metadata, state_dir / METADATA_FILE)
    params_keys = [keys for keys, _ in arrays if keys[0] == PARAMS_GROUP and len(keys) > 1]
    if not params_keys:
        groups = sorted({keys[0] for keys, _ in arrays}) or ["none"]
        raise ConversionError(
            f"orbax checkpoint {state_dir} has no '{PARAMS_GROUP}' arrays "
            f"(top-level groups: {', '.join(groups)})"
        )
    notices += skipped_notices(arrays)
    values = read_arrays(state_dir, metadata, params_keys)
    params = {key.split("/", 1)[1]: value for key, value in values.items()}
    return params, notices
