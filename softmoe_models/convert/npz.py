"""Reader for ``.npz`` files of flattened flax params.

Keys are flax paths joined with '/', e.g. ``Encoder/encoderblock_0/Mlp/Dense_0/kernel``. They may
sit under a ``params/`` prefix next to other groups (the golden files also hold ``inputs/``,
``outputs/``, ``acts/``, ...): when any key starts with ``params/``, only that subtree is taken and
every other top-level group is reported in one notice. Pickled (object) arrays are refused.

:func:`split_params` and :func:`ignored_notice` are shared with the other readers.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Mapping, Union

import numpy as np

from .errors import ConversionError

PathLike = Union[str, "os.PathLike[str]"]

PARAMS_GROUP = "params"

# Why a top-level group is left out, shown next to the count.
GROUP_NOTES = {
    "opt_state": "optimizer state",
    "rngs": "PRNG keys",
    "step": "training step",
}


def ignored_notice(group: str, count: int, is_leaf: bool = False) -> str:
    """Human-readable notice for a skipped top-level group.

    Args:
        group: top-level key.
        count: number of arrays under it.
        is_leaf: the group is a single array rather than a subtree.
    """
    note = GROUP_NOTES.get(group)
    suffix = f" ({note})" if note else ""
    if is_leaf:
        return f"ignored array {group}{suffix}"
    noun = "array" if count == 1 else "arrays"
    return f"ignored {count} {noun} under {group}/{suffix}"


def split_params(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Take the ``params/`` subtree when there is one; otherwise everything is params.

    Args:
        arrays: '/'-joined key -> array.

    Returns:
        Params keyed relative to ``params/`` and one notice per other top-level group.
    """
    prefix = PARAMS_GROUP + "/"
    if not any(key.startswith(prefix) for key in arrays):
        return dict(arrays), []
    params: dict[str, np.ndarray] = {}
    groups: dict[str, int] = {}
    leaves: set[str] = set()
    for key, value in arrays.items():
        if key.startswith(prefix):
            params[key[len(prefix):]] = value
            continue
        group = key.split("/", 1)[0]
        groups[group] = groups.get(group, 0) + 1
        if "/" not in key:
            leaves.add(group)
    notices = [
        ignored_notice(group, count, is_leaf=group in leaves and count == 1)
        for group, count in groups.items()
    ]
    return params, notices


ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # local file header, empty archive
NPY_MAGIC = b"\x93NUMPY"


def _check_magic(path: Path) -> None:
    """Refuse files that are not zip archives before numpy guesses (it would try pickle).

    Args:
        path: the supposed ``.npz`` file.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise ConversionError(f"cannot read npz file {path}: {e.strerror or e}") from e
    if head.startswith(NPY_MAGIC):
        raise ConversionError(f"{path} is a single .npy array, not an .npz archive of params")
    if not head.startswith(ZIP_MAGICS):
        raise ConversionError(f"{path} is not an .npz archive (no zip signature at its start)")


def _load_members(path: Path) -> dict[str, np.ndarray]:
    """Load every array of an npz file, refusing pickles and non-array members.

    Args:
        path: the ``.npz`` file.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ConversionError(f"{path} holds a single .npy array, not an .npz archive")
            arrays = {}
            for name in archive.files:
                value = archive[name]
                if not isinstance(value, np.ndarray):
                    raise ConversionError(
                        f"{path}: member {name!r} is not a numpy array (.npy); "
                        "is this a zip archive rather than an .npz file?"
                    )
                arrays[name] = value
            return arrays
    except ConversionError:
        raise
    except FileNotFoundError as e:
        raise ConversionError(f"npz file {path} does not exist") from e
    except (zipfile.BadZipFile, EOFError) as e:
        raise ConversionError(f"{path} is not a valid .npz archive (truncated or corrupt: {e})") from e
    except ValueError as e:
        if "pickle" in str(e):
            raise ConversionError(
                f"{path} contains pickled object arrays, which are refused; save plain arrays"
            ) from e
        raise ConversionError(f"{path} is not a valid .npz archive ({e})") from e
    except Exception as e:  # OSError, numpy format errors, ...
        raise ConversionError(f"cannot read npz file {path}: {type(e).__name__}: {e}") from e


def read_npz(path: PathLike) -> tuple[dict[str, np.ndarray], list[str]]:
    """Read flattened flax params from an ``.npz`` file.

    Args:
        path: the ``.npz`` file.

    Returns:
        Params keyed by '/'-joined path (relative to ``params/`` when present) and notices about
        the top-level groups that were left out.

    Raises:
        ConversionError: the file is missing, not an npz archive, holds pickles or no arrays.
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"npz file {path} does not exist or is not a file")
    _check_magic(path)
    arrays = _load_members(path)
    if not arrays:
        raise ConversionError(f"{path} contains no arrays")
    params, notices = split_params(arrays)
    if not params:  # pragma: no cover - split_params only selects a non-empty prefix
        raise ConversionError(f"{path} contains no params arrays")
    return params, notices
